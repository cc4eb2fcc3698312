"""async_ckpt: asynchronous checkpointing for PyTorch and PyTorch/XLA.

``CheckpointManager.save_async`` blocks only while host copies are made (one batched transfer
into reused host buffers), then writes a DCP checkpoint through fsspec in the background and
commits it atomically.
"""

from .errors import (
    CheckpointError,
    CoordinationError,
    CorruptCheckpointError,
    CorruptPartlyWrittenError,
    ForeignStepError,
    FrozenTensorChangedError,
    InvalidArgumentError,
    InvalidStateDictError,
    InvalidStepError,
    LeaseHeldError,
    NotACheckpointRootError,
    PartlyWrittenError,
    RankFailure,
    StagingBudgetError,
    StateDictMismatchError,
    StepAlreadyExistsError,
    StepNotFoundError,
    StorageError,
    StoragePartlyWrittenError,
    StorageTimeoutError,
    TornSnapshotError,
    UnsafeCheckpointError,
    WriterProcessError,
)
from .jobs.roots import StepMetadata
from .manager import CheckpointManager
from .policies import (
    AnyOf,
    AtSteps,
    CheckpointInfo,
    Continuous,
    EveryNSteps,
    EveryTSeconds,
    KeepAll,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    KeepTimeInterval,
    OnPreemption,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
)
from .staging.frozen import frozen_keys
from .stats import SaveStats

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CoordinationError",
    "CheckpointInfo",
    "CheckpointManager",
    "CorruptCheckpointError",
    "CorruptPartlyWrittenError",
    "ForeignStepError",
    "FrozenTensorChangedError",
    "InvalidArgumentError",
    "EveryNSteps",
    "InvalidStateDictError",
    "InvalidStepError",
    "LeaseHeldError",
    "NotACheckpointRootError",
    "PartlyWrittenError",
    "RankFailure",
    "KeepAll",
    "KeepLatest",
    "RetentionPolicy",
    "SavePolicy",
    "SaveStats",
    "StagingBudgetError",
    "StateDictMismatchError",
    "StepAlreadyExistsError",
    "StepMetadata",
    "StepNotFoundError",
    "StorageError",
    "StoragePartlyWrittenError",
    "StorageTimeoutError",
    "TornSnapshotError",
    "UnsafeCheckpointError",
    "WriterProcessError",
    "AnyOf",
    "AtSteps",
    "Continuous",
    "EveryTSeconds",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepTimeInterval",
    "OnPreemption",
    "SaveContext",
    "frozen_keys",
    "__version__",
]
