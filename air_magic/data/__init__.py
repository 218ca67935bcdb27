"""air_magic.data: stream files from a directory or any fsspec URL, resume anywhere, checkpoint anywhere.

- `StreamingFileDataset` (alias `UCVolumeDataset`): every file once per epoch, one seeded global order
  whatever the number of ranks and DataLoader workers; remote files through a private byte-capped cache.
- `DataLoader`: torch's DataLoader with `state_dict()` / `load_state_dict()` that resume on any layout.
- `CheckpointWriter` / `CheckpointReader` (aliases `UCVolumeWriter` / `UCVolumeReader`): storage for
  `torch.distributed.checkpoint.save / async_save / load` at any fsspec URL, `.metadata` written last.
"""

from __future__ import annotations

from .checkpoint import CheckpointReader, CheckpointWriter
from .dataset import StreamingFileDataset
from .loader import DataLoader

UCVolumeDataset = StreamingFileDataset
UCVolumeWriter = CheckpointWriter
UCVolumeReader = CheckpointReader

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "DataLoader",
    "StreamingFileDataset",
    "UCVolumeDataset",
    "UCVolumeReader",
    "UCVolumeWriter",
]
