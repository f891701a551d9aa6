"""Reading `serialized_named_tensors` (SGLang's `/update_weights_from_tensor`) without trusting it.

An entry is base64 of a pickle made by torch.multiprocessing's reductions: handles to memory another process on
this host shares (a `/dev/shm/torch_*` file name on CPU, a CUDA IPC handle on GPU), not the tensors' bytes. A
request body is hostile input, and `pickle.loads` runs whatever callable the pickle names, so:

- `find_class` resolves only the exact names torch's reductions emit (the rebuild functions, the storage and
  tensor classes, `torch.Size`, a list of dtypes, `_codecs.encode` for latin-1 bytes), and each resolves to a
  checking stand-in here, never to the class itself: a pickle may call what it names, and calling
  `torch.UntypedStorage(10**12)` would allocate a terabyte;
- the stand-ins check every argument before torch sees it: a shared-memory name must look like torch's and name
  a file of this user in /dev/shm at least as large as the size asked for (mapping past a file's end kills the
  process at the first read), the manager socket must be one of this user's torch managers, a tensor must lie
  inside its storage;
- BUILD (setting an object's state) is refused, except the six fields of SGLang's `FlattenedTensorMetadata`
  (load_format "flattened_bucket"), which resolves to a plain stand-in class here;
- work is bounded: at most MAX_OPS opcodes and MAX_DEPTH levels of nesting per entry, dict keys only plain
  scalars and no sets (hashing a tuple that shares itself level after level takes exponential time), and every
  value shown in an error goes through lichen.excerpt (a 260-byte pickle once made a 124 MB error message);
- anything else (an unknown name, a wrong type, a malformed pickle) raises PayloadError, which the endpoint
  answers with 400.

The result must be a list of (name, tensor) pairs (`load_format` null), or SGLang's flattened bucket
(`{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}`, each tensor a checked view of the
bucket); the tensors map the sender's memory
until they are dropped, so the endpoint copies them into its parameters and lets them go.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
import stat
from typing import Any, ClassVar

import torch
from torch.multiprocessing import reductions

from lichen.excerpt import clip, excerpt

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")  # what torch's file_system strategy names a segment
MAX_DIMS = 16
# A tensor's handle takes ~40 opcodes, so a million is far beyond any model's list; 32 levels is far beyond the
# 4 of torch's reductions (list > tuple > tuple > metadata).
MAX_OPS = 1_000_000
MAX_DEPTH = 32
_KEY_TYPES = (str, bytes, int, float, bool, type(None))
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


class PayloadError(ValueError):
    """The entry cannot be read safely or is not what `/update_weights_from_tensor` takes."""


class _Class:
    """What a pickle gets for a class name: a token, not callable, that only the rebuild stand-ins accept."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _is(obj: Any, name: str) -> bool:
    return isinstance(obj, _Class) and obj.name == name


def _int(v: Any, what: str, low: int = 0) -> int:
    if type(v) is not int or v < low:
        raise PayloadError(f"{what} must be an integer >= {low}, got {excerpt(v)}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) > MAX_DIMS:
        raise PayloadError(f"{what} must be a tuple of at most {MAX_DIMS} integers, got {excerpt(v)}")
    return tuple(_int(x, what) for x in v)


def _size(dims: Any) -> torch.Size:
    return torch.Size(_ints(dims, "a torch.Size"))


def _latin1(text: Any, encoding: Any) -> bytes:
    """`_codecs.encode`, as protocols below 3 write bytes: latin-1 of a short string only."""
    if encoding != "latin1" or not isinstance(text, str) or len(text) > 4096:
        raise PayloadError("_codecs.encode is accepted only for latin-1 bytes")
    return text.encode("latin1")


def _shm_file(handle: Any, size: int) -> None:
    if not isinstance(handle, bytes) or not SHM_NAME.fullmatch(handle):
        raise PayloadError(f"shared memory name {excerpt(handle)} is not one torch makes (/torch_<pid>_<n>_<n>)")
    path = SHM_DIR + handle.decode()
    try:
        st = os.stat(path)
    except OSError as e:
        raise PayloadError(
            f"shared memory {handle.decode()} cannot be opened here ({e.strerror}): the sender must run on this host"
        ) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PayloadError(f"shared memory {handle.decode()} is not a file of this server's user")
    if st.st_size < size:
        raise PayloadError(f"shared memory {handle.decode()} holds {st.st_size} bytes, fewer than the {size} asked for")


def _manager(manager: Any) -> None:
    if (
        not isinstance(manager, bytes)
        or os.path.basename(manager) != b"manager.sock"
        or not os.path.basename(os.path.dirname(manager)).startswith(b"torch-shm-dir-")
    ):
        raise PayloadError(f"shared memory manager {excerpt(manager)} is not a torch shm manager socket")
    try:
        st = os.stat(manager)
    except OSError:
        raise PayloadError(f"shared memory manager {manager.decode(errors='replace')} does not exist here") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise PayloadError("shared memory manager socket is not one of this server's user")


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    if not _is(cls, "UntypedStorage") or dtype is not None:
        raise PayloadError("rebuild_storage_filename: only untyped storages are accepted")
    size = _int(size, "a storage size", 1)
    _shm_file(handle, size)
    _manager(manager)
    return reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)


def _rebuild_storage_empty(cls: Any) -> torch.UntypedStorage:
    if not _is(cls, "UntypedStorage"):
        raise PayloadError("rebuild_storage_empty: only untyped storages are accepted")
    return torch.UntypedStorage()


def _rebuild_typed_storage(storage: Any, dtype: Any) -> Any:
    if not isinstance(storage, torch.UntypedStorage) or dtype not in DTYPES.values():
        raise PayloadError("rebuild_typed_storage: expected a rebuilt storage and a dtype")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    if not (_is(cls, "Tensor") or _is(cls, "Parameter")) or not isinstance(storage, torch.TypedStorage):
        raise PayloadError("rebuild_tensor: expected a tensor class and a rebuilt storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise PayloadError("rebuild_tensor: metadata must be (offset, size, stride, requires_grad)")
    offset = _int(metadata[0], "a tensor offset")
    shape, stride = _ints(metadata[1], "a tensor size"), _ints(metadata[2], "a tensor stride")
    if len(shape) != len(stride):
        raise PayloadError("rebuild_tensor: size and stride differ in length")
    if all(shape) and offset + sum((n - 1) * s for n, s in zip(shape, stride)) >= storage._size():
        raise PayloadError(
            f"a tensor of size {shape} at offset {offset} runs past its storage of {storage._size()} elements"
        )
    return reductions.rebuild_tensor(torch.Tensor, storage, (offset, torch.Size(shape), stride, False))


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """CUDA IPC handles (untested without a GPU): the device comes as the GPU's UUID (SGLang's convention) or an
    index; it is mapped to this process's index of that GPU."""
    if not torch.cuda.is_available():
        raise PayloadError("the payload holds CUDA IPC handles, and this server has no CUDA device")
    if len(args) != 15:
        raise PayloadError("rebuild_cuda_tensor: unexpected arguments")
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        device,
        handle,
        nbytes,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        sync,
    ) = args
    if (
        not (_is(tensor_cls, "Tensor") or _is(tensor_cls, "Parameter"))
        or not (_is(storage_cls, "TypedStorage") or _is(storage_cls, "UntypedStorage"))
        or dtype not in DTYPES.values()
    ):
        raise PayloadError("rebuild_cuda_tensor: expected tensor and storage classes and a dtype")
    _ints(size, "a tensor size"), _ints(stride, "a tensor stride")
    for v, what in (
        (offset, "a tensor offset"),
        (nbytes, "a storage size"),
        (storage_offset, "a storage offset"),
        (ref_offset, "a ref-counter offset"),
    ):
        _int(v, what)
    if (
        not all(isinstance(h, bytes) for h in (handle, ref_handle))
        or not isinstance(sync, bool)
        or not (event_handle is None or isinstance(event_handle, bytes))
    ):
        raise PayloadError("rebuild_cuda_tensor: handles must be bytes")
    _shm_file(ref_handle, 1)
    if isinstance(device, str):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if device not in uuids:
            raise PayloadError(f"GPU {clip(device)} is not visible to this server")
        device = uuids.index(device)
    elif _int(device, "a device index") >= torch.cuda.device_count():
        raise PayloadError(f"device index {device} is not visible to this server")
    storage_type = torch.UntypedStorage if _is(storage_cls, "UntypedStorage") else torch.TypedStorage
    return reductions.rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        storage_type,
        dtype,
        device,
        handle,
        nbytes,
        storage_offset,
        False,
        ref_handle,
        ref_offset,
        event_handle,
        sync,
    )


class FlatMeta:
    """What a pickle gets for SGLang's `FlattenedTensorMetadata` (load_format "flattened_bucket"): a plain object
    whose state only the BUILD below sets, and only to these fields."""

    FIELDS = frozenset({"name", "shape", "dtype", "start_idx", "end_idx", "numel"})

    def __repr__(self) -> str:
        return f"FlattenedTensorMetadata({excerpt(vars(self))})"


# where SGLang's releases define it (slime pickles it by its own import of SGLang)
FLAT_META = {
    (m, "FlattenedTensorMetadata")
    for m in ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner")
}

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED: dict[tuple[str, str], Any] = {
    (_REDUCTIONS, "rebuild_tensor"): _rebuild_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): _rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): _rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_storage_empty"): _rebuild_storage_empty,
    (_REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch", "Size"): _size,
    ("_codecs", "encode"): _latin1,
    **{("torch", name): dtype for name, dtype in DTYPES.items()},
}
CLASSES = {
    ("torch.storage", "UntypedStorage"): "UntypedStorage",
    ("torch.storage", "TypedStorage"): "TypedStorage",
    ("torch", "Tensor"): "Tensor",
    ("torch.nn.parameter", "Parameter"): "Parameter",
}


_BASE: Any = pickle._Unpickler


class _Unpickler(pickle._Unpickler):  # the Python unpickler: its opcode table can be narrowed, the C one's not
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the pure-Python unpickler's state (not in typeshed)
    metastack: list[list[Any]]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in FLAT_META:
            return FlatMeta
        if (module, name) in CLASSES:
            return _Class(CLASSES[(module, name)])
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise PayloadError(
                f"the payload names {module}.{name}, which is not one of torch's tensor rebuild functions"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise PayloadError("persistent ids are not accepted")

    def _build(self) -> None:
        """BUILD only sets a FlatMeta's fields (a dataclass pickles so); anything else is refused."""
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is not FlatMeta or not isinstance(state, dict) or set(state) != FlatMeta.FIELDS:
            raise PayloadError("setting an object's state (BUILD) is accepted only for FlattenedTensorMetadata")
        for key, value in state.items():
            object.__setattr__(inst, key, value)

    dispatch[pickle.BUILD[0]] = _build

    def _keys(self, keys: list) -> None:
        # dict keys are hashed, and hashing a tuple walks all of it: only plain scalars (torch's reductions and
        # SGLang's metadata use str keys), so no key can cost more than its own bytes
        if not all(type(k) in _KEY_TYPES for k in keys):
            raise PayloadError("dictionary keys must be strings or numbers")

    def _setitem(self) -> None:
        self._keys([self.stack[-2]])
        _BASE.load_setitem(self)

    def _setitems(self) -> None:  # after a MARK: self.stack holds key, value, key, value, ...
        self._keys(self.stack[0::2])
        _BASE.load_setitems(self)

    def _dict(self) -> None:
        self._keys(self.stack[0::2])
        _BASE.load_dict(self)

    def _no_sets(self) -> None:
        raise PayloadError("sets are not part of a tensor payload")

    dispatch[pickle.SETITEM[0]] = _setitem
    dispatch[pickle.SETITEMS[0]] = _setitems
    dispatch[pickle.DICT[0]] = _dict
    for _op in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET):
        dispatch[_op[0]] = _no_sets
    # every opcode counts against MAX_OPS, and MARK nesting against MAX_DEPTH
    dispatch = {code: (lambda f: lambda self: self._step(f))(f) for code, f in dispatch.items()}
    _ops = 0

    def _step(self, op: Any) -> None:
        self._ops += 1
        if self._ops > MAX_OPS:
            raise PayloadError(f"the payload runs past {MAX_OPS} pickle operations; it is not a list of handles")
        if len(self.metastack) > MAX_DEPTH:
            raise PayloadError(f"the payload nests deeper than {MAX_DEPTH} levels")
        op(self)


def _check_depth(obj: Any) -> None:
    """Refuse a result nested deeper than MAX_DEPTH (or holding itself): each container is looked at once, so a
    structure that shares one list at every level costs its size in the pickle, not its unfolded size."""
    depth: dict[int, int] = {}  # id -> levels below (the objects live in `obj` meanwhile)
    todo: list[tuple[Any, bool]] = [(obj, False)]
    open_: set[int] = set()
    while todo:
        x, done = todo.pop()
        if not isinstance(x, (list, tuple, dict)):
            continue
        kids = list(x.values()) if isinstance(x, dict) else list(x)
        if done:
            open_.discard(id(x))
            depth[id(x)] = 1 + max((depth.get(id(k), 0) for k in kids), default=0)
            if depth[id(x)] > MAX_DEPTH:
                raise PayloadError(f"the payload nests deeper than {MAX_DEPTH} levels")
            continue
        if id(x) in depth:
            continue
        if id(x) in open_:
            raise PayloadError("the payload contains itself")
        open_.add(id(x))
        todo.append((x, True))
        todo.extend((k, False) for k in kids if id(k) not in depth)


def _flattened_bucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """SGLang's FlattenedTensorBucket: views of one uint8 tensor, each checked to lie inside it."""
    flat, metas = obj.get("flattened_tensor"), obj.get("metadata")
    if (
        set(obj) != {"flattened_tensor", "metadata"}
        or not isinstance(flat, torch.Tensor)
        or flat.dtype != torch.uint8
        or flat.dim() != 1
        or not isinstance(metas, list)
    ):
        raise PayloadError("a flattened_bucket entry must be {flattened_tensor: a 1-D uint8 tensor, metadata: [...]}")
    out = []
    for m in metas:
        if type(m) is not FlatMeta or not isinstance(m.name, str) or m.dtype not in DTYPES.values():
            raise PayloadError("flattened_bucket metadata must be FlattenedTensorMetadata with a name and a dtype")
        shape = _size(m.shape)
        start, end = _int(m.start_idx, "start_idx"), _int(m.end_idx, "end_idx")
        nbytes = shape.numel() * m.dtype.itemsize
        if end - start != nbytes or m.numel != nbytes or end > flat.numel():
            raise PayloadError(
                f"{clip(m.name)}: bytes [{start}, {end}) do not hold {tuple(shape)} {m.dtype} inside the "
                f"bucket of {flat.numel()} bytes"
            )
        out.append((m.name, flat[start:end].view(m.dtype).view(shape)))
    return out


def load_named_tensors(entry: Any, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry as (name, tensor) pairs; PayloadError for anything else.
    `load_format` None (or "direct"): a list of pairs; "flattened_bucket": SGLang's FlattenedTensorBucket."""
    if not isinstance(entry, str):
        raise PayloadError("each serialized_named_tensors entry must be a base64 string")
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"not base64: {e}") from None
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
        _check_depth(obj)
    except PayloadError:
        raise
    except Exception as e:  # a malformed pickle, or a stand-in called with the wrong number of arguments
        raise PayloadError(f"not a tensor payload: {type(e).__name__}: {clip(str(e))}") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict):
            raise PayloadError("a flattened_bucket entry must be {flattened_tensor, metadata}")
        return _flattened_bucket(obj)
    if not isinstance(obj, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in obj
    ):
        raise PayloadError("the payload must be a list of (name, tensor) pairs (load_format null)")
    return obj
