# Load air_magic in every IPython kernel and set the defaults of %%distributed cells.
#
# Every kernel of your user (IPython profile):
#     ipython profile create
#     cat jupyter-config/ipython_kernel_config.py >> "$(ipython locate profile)/ipython_kernel_config.py"
# Every kernel of one Python environment (read from <sys.prefix>/etc/ipython/):
#     mkdir -p "$VIRTUAL_ENV/etc/ipython"
#     cp jupyter-config/ipython_kernel_config.py "$VIRTUAL_ENV/etc/ipython/"
# Change a default in a running kernel with %config, e.g. %config DistributedMagics.default_timeout = 600

c = get_config()  # noqa: F821 - IPython provides get_config() when it reads this file

# The same as `%load_ext air_magic` at the start of every kernel; keeps extensions configured elsewhere.
c.InteractiveShellApp.extensions.append("air_magic")

# Defaults for %%distributed cells (shown with their built-in values); a cell's own options win.
# c.DistributedMagics.default_timeout = 3 * 60 * 60    # seconds; None: no limit (--timeout)
# c.DistributedMagics.default_accelerator_type = None  # "CPU", "GPU", "GPU_8xH100"; None: detected (--accelerator-type)
# c.DistributedMagics.default_num_accelerators = None  # None: every GPU, or 2 CPU workers without GPUs (--gpus)
# c.DistributedMagics.mlflow = True                    # False: as if every cell had --no-mlflow
