"""A stand-in for the tensors neuronx-distributed's runtime keeps on a NeuronCore: the
KV cache state of a loaded model (`nxd_model.state`, one dict per rank, created on the
host and moved to `privateuseone:{rank}` by trace/spmd.py StateInitializer.forward, 0.18
lines 109-141; under NEURON_COMBINE_KV_ALLOCATIONS K and V are views of one combined
tensor there).

What a client can do with such a tensor, and what the stand-in refuses (RuntimeError):
- views (`view`, `narrow`, basic indexing by ints and slices) share its memory: allowed;
- device -> host copies (`.cpu()`, `.to("cpu")`, `copy_` into a host tensor) of a
  contiguous tensor: allowed, they answer a host copy; NxDI reads the state only so
  (utils/debug_utils.py lines 68-72, utils/snapshot.py line 339). Of a non-contiguous
  one: refused (reported against the Neuron runtime, SDK 2.31 on trn2);
- host -> device `copy_` from a contiguous host tensor into a contiguous device one:
  allowed;
- device -> device `copy_` between tensors of different parents: refused (the runtime's
  `nrt_tensor_copy` fails between differently sized parents, reported as above);
- gathering and scattering by an index tensor (`index_select`, `index_copy_`,
  `index_put_`, advanced indexing, ...): refused; on the device they run over the whole
  tensor (reported above: "over a minute" for a full-size cache), which a KV block move
  must never cost;
- `.numpy()`: refused (copy to the host first).
The double's own graphs compute on the same memory through plain aliases (`alias`),
as traced graphs update their state in place. Test instrumentation: `TRANSFERS` lists
(direction, bytes) of every host<->device copy, "to_host" or "to_device", and
`TRANSFER_THREADS` the thread that issued each (a copy blocks its caller: the copies
one thread issues run one after another)."""

import threading

import torch

# torch functions that gather or scatter by an index tensor
_INDEXED = frozenset({
    "index_select", "index_copy", "index_copy_", "index_put", "index_put_", "index_add",
    "index_add_", "index_fill", "index_fill_", "gather", "scatter", "scatter_", "take",
    "put_", "masked_select", "masked_scatter_",
})


TRANSFERS = []
TRANSFER_THREADS = []


def _record(direction, size):
    TRANSFERS.append((direction, size))
    TRANSFER_THREADS.append(threading.current_thread())


def _advanced(index) -> bool:
    """Whether a subscript gathers (a tensor, list or array index), not a view."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(not isinstance(p, (int, slice, type(None), type(Ellipsis))) for p in parts)


def _parent(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class DeviceTensor(torch.Tensor):
    """See the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _INDEXED:
            raise RuntimeError(f"NxD device tensor: {name} is not run on a NeuronCore's "
                               f"state tensor here (it costs the whole tensor); move "
                               f"contiguous slices (narrow) instead")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _advanced(args[1]):
            raise RuntimeError("NxD device tensor: indexing by a tensor or list gathers "
                               "over the whole tensor; move contiguous slices instead")
        if func is torch.Tensor.numpy:
            raise RuntimeError("NxD device tensor: copy it to the host (.cpu()) first")
        if func in (torch.Tensor.cpu, torch.Tensor.to):
            return _to_host(args[0], name).to(*args[1:], **kwargs)
        if func is torch.Tensor.copy_:
            _check_copy(args[0], args[1])
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(tensor, name):
    if not alias(tensor).is_contiguous():
        raise RuntimeError(f"NxD device tensor: a device-to-host copy ({name}) of a "
                           f"non-contiguous tensor (shape {tuple(tensor.shape)}, stride "
                           f"{alias(tensor).stride()}) fails in the Neuron runtime")
    _record("to_host", tensor.numel() * tensor.element_size())
    return alias(tensor).clone()


def _check_copy(destination, source):
    on_device = isinstance(destination, DeviceTensor), isinstance(source, DeviceTensor)
    if all(on_device) and _parent(destination) != _parent(source):
        raise RuntimeError("NxD device tensor: a device-to-device copy between different "
                           "parent tensors fails in the Neuron runtime (nrt_tensor_copy "
                           "status=2); copy through the host")
    if on_device[0] == on_device[1]:
        return  # within one parent on the device
    if not (alias(destination).is_contiguous() and alias(source).is_contiguous()):
        raise RuntimeError("NxD device tensor: a copy between host and device needs "
                           "contiguous tensors on both sides")
    direction = "to_device" if on_device[0] else "to_host"
    _record(direction, source.numel() * source.element_size())


def on_device(tensor):
    """`tensor` (a host tensor) as the stand-in device tensor of the same memory."""
    return tensor.as_subclass(DeviceTensor)


def alias(tensor):
    """A plain tensor sharing `tensor`'s memory (the double's graphs compute on it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)
