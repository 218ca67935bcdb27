"""The public surface: what users import from air_magic, and the settings types of the runtime we mirror."""

from __future__ import annotations

import warnings

import pytest

import air_magic
from air_magic import AcceleratorType, GPUType, distributed

PUBLIC = {
    "AcceleratorType",
    "AirMagicError",
    "Alert",
    "ConfigurationError",
    "DebuggerQuit",
    "DistributedCall",
    "DistributedTimeoutError",
    "GPUType",
    "JobCancelledError",
    "JobResult",
    "JobStatus",
    "PayloadSizeWarning",
    "Placeholder",
    "Profile",
    "RankFailedError",
    "RankHungError",
    "RankResult",
    "RankState",
    "Ref",
    "ResultSizeWarning",
    "RunDirectoryFullError",
    "SerializationError",
    "WorkerDiedError",
    "__version__",
    "attach",
    "distributed",
    "load_ipython_extension",
    "ray_init",
    "should_stop",
    "step",
    "sweep",
    "unload_ipython_extension",
}


def test_all_lists_exactly_the_public_names_and_each_exists():
    """air_magic.__all__ is the agreed public list, every name in it resolves, and every exception users catch is in
    it."""
    assert set(air_magic.__all__) == PUBLIC
    for name in air_magic.__all__:
        assert getattr(air_magic, name) is not None, name
    from air_magic import errors

    exceptions = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.AirMagicError)}
    assert exceptions <= set(air_magic.__all__)
    assert issubclass(air_magic.ResultSizeWarning, UserWarning) and issubclass(
        air_magic.PayloadSizeWarning, UserWarning
    )


def test_accelerator_type_members_are_strings_accepted_where_a_string_is():
    """AcceleratorType members equal their type strings and select the same world as the string does."""
    assert AcceleratorType.GPU_8xH100 == "GPU_8xH100" and AcceleratorType.GPU_1xA10 == "GPU_1xA10"
    assert AcceleratorType.GPU_8xB300 == "GPU_8xB300" and AcceleratorType.CPU == "CPU"
    fn = distributed(1, accelerator_type=AcceleratorType.CPU)(print)
    assert fn.settings.resolve() == (1, "CPU")
    with pytest.raises(air_magic.ConfigurationError, match="none were detected"):
        distributed(accelerator_type=AcceleratorType.GPU_8xH100)


def test_gpu_type_is_deprecated_like_gpu_type_and_still_understood():
    """GPUType members are strings; passing one gives the FutureWarning of gpu_type and is read as that model."""
    assert GPUType.H100 == "H100" and GPUType.A10 == "A10" and GPUType.B300 == "B300"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(air_magic.ConfigurationError, match="none were detected"):
            distributed(gpu_type=GPUType.H100)
    assert [w.category for w in caught] == [FutureWarning] and "accelerator_type" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(air_magic.ConfigurationError, match="none were detected"):
            distributed(accelerator_type=GPUType.H100)
    assert [w.category for w in caught] == [FutureWarning]
