"""Checkpoint I/O (safetensors, HF layout), the weight delta codec, published versions and the engine-side pull.

A leaf: imports torch, safetensors, numpy, zstandard, xxhash, blake3 and the standard library (ctypes reaches the
system's libzstd when present), nothing of lichen outside this package.
"""

from lichen.weights.delta_codec import (
    CHECKSUM_FORMATS,
    COMPRESSION_FORMAT,
    ENCODINGS,
    ChecksumMismatchError,
    DeltaError,
    EncodedTensor,
    VersionMismatchError,
    apply_tensor,
    apply_tensor_at,
    checksum,
    decode_tensor,
    encode_tensor,
    encode_tensor_cast,
    new_hasher,
    tensor_bytes,
)
from lichen.weights.hf_io import load_hf_metadata, load_hf_state_dict, safetensors_files, save_hf_checkpoint
from lichen.weights.pull import (
    SYNC_DIR,
    PullResult,
    apply_delta_in_place,
    apply_delta_to_checkpoint,
    apply_delta_to_tensors,
    local_checkpoint_lock,
    plan_pull,
    pull_weights,
    read_applied_version,
    read_local_state,
    seed_local_checkpoint,
    tensor_locations,
    verify_checkpoint,
)
from lichen.weights.staging import LiveStage
from lichen.weights.versions import (
    PublishResult,
    VersionInfo,
    VersionPublisher,
    delete_versions,
    list_versions,
    newest_full_version,
    read_version_info,
    version_dir,
)

__all__ = [
    "CHECKSUM_FORMATS", "COMPRESSION_FORMAT", "ENCODINGS", "SYNC_DIR", "ChecksumMismatchError", "DeltaError",
    "EncodedTensor", "LiveStage", "PublishResult", "PullResult", "VersionInfo", "VersionMismatchError",
    "VersionPublisher", "apply_delta_in_place", "apply_delta_to_checkpoint", "apply_delta_to_tensors",
    "apply_tensor", "apply_tensor_at", "checksum", "decode_tensor", "delete_versions",
    "encode_tensor", "encode_tensor_cast", "list_versions", "load_hf_metadata", "load_hf_state_dict",
    "local_checkpoint_lock", "new_hasher", "newest_full_version", "plan_pull", "pull_weights",
    "read_applied_version", "read_local_state", "read_version_info", "safetensors_files", "save_hf_checkpoint",
    "seed_local_checkpoint", "tensor_bytes", "tensor_locations", "verify_checkpoint", "version_dir",
]
