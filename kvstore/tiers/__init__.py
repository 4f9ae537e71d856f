"""KV tiers below a worker's own cache: host memory, then files (a 3FS mount or any
POSIX directory) shared by every worker of the machine."""

from kvstore.tiers.events import TierEvents
from kvstore.tiers.file import FileTier
from kvstore.tiers.fileio import BlockIO, PosixIO, open_block_io
from kvstore.tiers.format import BlockMeta, CorruptBlock
from kvstore.tiers.host import HostTier

__all__ = [
    "BlockIO",
    "BlockMeta",
    "CorruptBlock",
    "FileTier",
    "HostTier",
    "PosixIO",
    "TierEvents",
    "open_block_io",
]
