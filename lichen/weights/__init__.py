"""Checkpoint I/O (safetensors, HF layout), the weight delta codec, published versions and the engine-side pull.

This package's namespace holds what other parts use; the rest is imported from its module (e.g.
lichen.weights.staging.LiveStage).

A leaf: imports torch, safetensors, numpy, zstandard, xxhash, blake3 and the standard library (ctypes reaches the
system's libzstd when present), nothing of lichen outside this package.
"""

from lichen.weights.delta_codec import (
    ChecksumMismatchError,
    DeltaError,
    VersionMismatchError,
    apply_tensor,
    checksum,
    decode_tensor,
    encode_tensor,
    new_hasher,
    tensor_bytes,
)
from lichen.weights.hf_io import load_hf_metadata, load_hf_state_dict, safetensors_files, save_hf_checkpoint
from lichen.weights.live_delta import apply_delta_in_place, apply_delta_to_tensors
from lichen.weights.pull import (
    apply_delta_to_checkpoint,
    plan_pull,
    pull_weights,
    read_applied_version,
)
from lichen.weights.versions import (
    VersionPublisher,
    list_versions,
    newest_full_version,
    read_version_info,
    version_dir,
)

__all__ = [
    "ChecksumMismatchError",
    "DeltaError",
    "VersionMismatchError",
    "VersionPublisher",
    "apply_delta_in_place",
    "apply_delta_to_checkpoint",
    "apply_delta_to_tensors",
    "apply_tensor",
    "checksum",
    "decode_tensor",
    "encode_tensor",
    "list_versions",
    "load_hf_metadata",
    "load_hf_state_dict",
    "new_hasher",
    "newest_full_version",
    "plan_pull",
    "pull_weights",
    "read_applied_version",
    "read_version_info",
    "safetensors_files",
    "save_hf_checkpoint",
    "tensor_bytes",
    "version_dir",
]
