"""Checkpoint I/O (safetensors, HF layout) and, later, the weight delta codec. A leaf: imports nothing of lichen."""

from lichen.weights.hf_io import load_hf_metadata, load_hf_state_dict, safetensors_files, save_hf_checkpoint

__all__ = ["load_hf_metadata", "load_hf_state_dict", "safetensors_files", "save_hf_checkpoint"]
