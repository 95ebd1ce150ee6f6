"""A bucket's compiled graph as data: JSON calls of allow-listed ATen operators plus
safetensors constants. Loading one cannot run code from the file.

Why not `torch.export.save/load`: a `.pt2` archive is loaded with pickle (entries marked
`use_pickle` and the sample inputs fall back to `torch.load(weights_only=False)`), and its
JSON resolves call targets as any `torch.*` attribute path and parses symbolic shapes with
`sympy.sympify` (eval). Compiled artifacts travel through shared stores, so the format
here holds only: inputs (user inputs by position, constants by name from the
safetensors file), nodes `{"op": "aten.mul.Tensor", "args": [...], "kwargs": {...}}`
whose arguments are literals or references to earlier values, and outputs (user outputs,
and in-place updates of user inputs for graphs exported as functional). The loader
resolves each op only through `torch.ops.aten` and only if its name is in ALLOWED_OPS,
builds a `torch.fx.Graph` from those callables and literal values, and lets FX generate
the call code (names and literals are its own).

Calls that do nothing at run time are left out, each a call on every step: export's
metadata checks (`_assert_tensor_metadata`, which returns None) are skipped when written
and when read, and a conversion to the dtype its input already has (`to.dtype`, which
returns its input) is written as that input.

Torch versions: uses only `torch.export.export`, `ExportedProgram.graph_module /
graph_signature / state_dict / constants`, `torch.export.graph_signature.InputKind /
OutputKind`, `torch.fx.Graph / GraphModule`, `torch.ops.aten` overload packets and
`safetensors.torch.save / load`, all present in torch 2.9 and 2.13 (the two environments
the reference backend runs in).
"""

from __future__ import annotations

import json
import math
import operator
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch.export.graph_signature import InputKind, OutputKind

FORMAT = "neuron-reference-graph/1"

# ATen operators a reference decoder graph may call: elementwise math, reductions,
# matmuls, views, indexing and in-place cache writes. None reads or writes anything but
# its tensor arguments (no file, storage or pointer access such as from_file, set_ or
# as_strided). An op missing here fails the compile with its name, never the load.
ALLOWED_OPS = frozenset(
    {
        "_assert_tensor_metadata",
        "_softmax",
        "_to_copy",
        "_unsafe_view",
        "abs",
        "add",
        "addmm",
        "alias",
        "amax",
        "any",
        "arange",
        "bitwise_and",
        "bitwise_not",
        "bitwise_or",
        "bmm",
        "cat",
        "chunk",
        "clamp",
        "clone",
        "contiguous",
        "conv1d",
        "copy",
        "copy_",
        "cos",
        "cumsum",
        "detach",
        "div",
        "embedding",
        "empty",
        "eq",
        "exp",
        "expand",
        "fill_",
        "flatten",
        "floor",
        "floor_divide",
        "full",
        "full_like",
        "gather",
        "ge",
        "gelu",
        "layer_norm",
        "native_layer_norm",
        "gt",
        "index",
        "index_copy",
        "index_copy_",
        "index_put",
        "index_put_",
        "index_select",
        "le",
        "linear",
        "linalg_solve_triangular",
        "log",
        "log1p",
        "log_softmax",
        "logical_and",
        "logical_not",
        "logical_or",
        "lt",
        "masked_fill",
        "masked_fill_",
        "matmul",
        "max",
        "maximum",
        "mean",
        "min",
        "minimum",
        "mm",
        "mul",
        "ne",
        "neg",
        "ones",
        "ones_like",
        "pad",
        "permute",
        "pow",
        "reciprocal",
        "relu",
        "repeat",
        "repeat_interleave",
        "reshape",
        "rsqrt",
        "scaled_dot_product_attention",
        "scatter",
        "select",
        "sigmoid",
        "silu",
        "sin",
        "slice",
        "softmax",
        "softplus",
        "split",
        "split_with_sizes",
        "sqrt",
        "squeeze",
        "stack",
        "sub",
        "sum",
        "t",
        "tanh",
        "to",
        "topk",
        "transpose",
        "tril",
        "triu",
        "type_as",
        "unbind",
        "unsqueeze",
        "view",
        "where",
        "zeros",
        "zeros_like",
        "__and__",
        "__or__",
        "__xor__",
    }
)
_GETITEM = "getitem"
_ASSERT_NAME = "aten._assert_tensor_metadata.default"
_OP_RE = re.compile(r"aten\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
_DEVICE_RE = re.compile(r"cpu(:\d+)?")
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_LAYOUTS = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
_MEMORY_FORMATS = {
    str(v).removeprefix("torch."): v
    for v in vars(torch).values()
    if isinstance(v, torch.memory_format)
}


class GraphFileError(ValueError):
    """A graph cannot be written in, or a file is not valid in, the reference format."""


# -- writing -------------------------------------------------------------------------------
def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return _GETITEM
    name = str(target)
    match = _OP_RE.fullmatch(name) if isinstance(target, torch._ops.OpOverload) else None
    if match is None or match[1] not in ALLOWED_OPS:
        raise GraphFileError(
            f"the exported graph calls {name}, which the reference graph format does not "
            "allow; if it reads and writes only its tensor arguments, add its name to "
            "neuron_plugin.backends.reference.graph_file.ALLOWED_OPS"
        )
    return name


def _encode(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"ref": index[value]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v, index) for v in value]
    for kind, cls in (
        ("dtype", torch.dtype),
        ("layout", torch.layout),
        ("memory_format", torch.memory_format),
    ):
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise GraphFileError(
        f"the exported graph passes {value!r} ({type(value).__name__}), "
        "which the reference graph format cannot hold"
    )


def save_graph(exported: torch.export.ExportedProgram, folder: Path, name: str) -> None:
    """Write `name`.json (and `name`.safetensors with its constants) into `folder`."""
    signature = exported.graph_signature
    graph = exported.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders)}
    inputs: list[dict[str, Any]] = []
    user_index: dict[str, int] = {}
    constants: dict[str, torch.Tensor] = {}
    for node, spec in zip(placeholders, signature.input_specs, strict=True):
        if spec.kind == InputKind.USER_INPUT:
            user_index[node.name] = len(user_index)
            inputs.append({"user": user_index[node.name]})
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            source = (
                exported.state_dict if spec.target in exported.state_dict else exported.constants
            )
            constants[spec.target] = source[spec.target].detach().contiguous()
            inputs.append({"tensor": spec.target})
        else:
            raise GraphFileError(
                f"input {node.name} of kind {spec.kind.name} cannot be "
                "stored in the reference graph format"
            )
    nodes: list[dict[str, Any]] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _ASSERT_METADATA and not node.users:
            continue
        if node.op == "call_function" and _same_dtype_conversion(node):
            index[node] = index[node.args[0]]
            continue
        if node.op == "call_function":
            index[node] = len(placeholders) + len(nodes)
            nodes.append(
                {
                    "op": _op_name(node.target),
                    "args": _encode(node.args, index),
                    "kwargs": _encode_kwargs(node.kwargs, index),
                }
            )
        elif node.op not in ("placeholder", "output"):
            raise GraphFileError(
                f"the exported graph has a {node.op} node ({node.target}), "
                "which the reference graph format cannot hold"
            )
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    outputs = []
    for value, spec in zip(returned, signature.output_specs, strict=True):
        entry: dict[str, Any] = {"ref": index[value]}
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            entry["updates"] = user_index[spec.target]
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise GraphFileError(
                f"output of kind {spec.kind.name} cannot be stored in the reference graph format"
            )
        outputs.append(entry)
    document = {"format": FORMAT, "inputs": inputs, "nodes": nodes, "outputs": outputs}
    (folder / f"{name}.json").write_text(json.dumps(document, allow_nan=False))
    # Serialised in memory and written by Python, so a full disk is a plain ENOSPC.
    (folder / f"{name}.safetensors").write_bytes(save_tensors(constants))


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _same_dtype_conversion(node: torch.fx.Node) -> bool:
    """`aten.to.dtype(x, dtype)` where x already has that dtype and no copy or memory
    format is asked for: the call returns x itself."""
    if node.target is not torch.ops.aten.to.dtype or len(node.args) < 2:
        return False
    source, dtype = node.args[0], node.args[1]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    options = dict(zip(("non_blocking", "copy", "memory_format"), node.args[2:], strict=False))
    options.update(node.kwargs)
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and not options.get("copy", False)
        and options.get("memory_format") in (None, torch.preserve_format)
    )


def _encode_kwargs(kwargs: dict[str, Any], index: dict[torch.fx.Node, int]) -> dict:
    return {k: _encode(v, index) for k, v in kwargs.items()}


# -- reading -------------------------------------------------------------------------------
def _fail(path: Path, problem: str) -> GraphFileError:
    return GraphFileError(
        f"{path} is not a valid reference graph: {problem}; recompile "
        "(remove the compile-cache entry) with this plugin version"
    )


def _resolve_op(name: Any, path: Path) -> Any:
    if name == _GETITEM:
        return operator.getitem
    match = _OP_RE.fullmatch(name) if isinstance(name, str) else None
    if match is None or match[1] not in ALLOWED_OPS:
        raise _fail(path, f"operator {name!r} is not allowed")
    packet = getattr(torch.ops.aten, match[1], None)
    if packet is None or match[2] not in packet.overloads():
        raise _fail(path, f"operator {name!r} does not exist in torch {torch.__version__}")
    return getattr(packet, match[2])


class _Decoder:
    """Turns stored values into FX arguments, refusing anything but literals and
    references to values defined earlier."""

    def __init__(self, path: Path):
        self.path = path
        self.values: list[torch.fx.Node | None] = []

    def __call__(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict) and len(value) == 1:
            ((kind, item),) = value.items()
            if kind == "ref" and type(item) is int and 0 <= item < len(self.values):
                return self.values[item]
            if kind == "float" and item in ("inf", "-inf", "nan"):
                return float(item)
            tables: dict[str, dict[str, Any]] = {
                "dtype": _DTYPES,
                "layout": _LAYOUTS,
                "memory_format": _MEMORY_FORMATS,
            }
            table = tables.get(kind)
            if table is not None and item in table:
                return table[item]
            if kind == "device" and isinstance(item, str) and _DEVICE_RE.fullmatch(item):
                return torch.device(item)
        raise _fail(self.path, f"value {json.dumps(value)[:80]} is not allowed")


class LoadedGraph:
    """A loaded bucket graph, called like the exported module: (weights, *tensors).

    Its first call runs the FX module under TorchScript's tracer, and later calls run the
    trace: the same ATen calls with the same kernels (equal results, bit for bit), but
    TorchScript's interpreter dispatches each in a fraction of the Python that FX's
    generated code spends on it, and a small model's step is mostly that per-op cost (a
    1x256 decode of tiny Qwen3, 383 calls: 2.8 -> 1.4 ms). A bucket's graph has fixed
    shapes and no Python control flow, which is what a trace records faithfully."""

    def __init__(self, module: torch.fx.GraphModule):
        self.module = module
        self.traced: torch.jit.ScriptFunction | None = None

    def __call__(self, *args: Any) -> Any:
        flat = tuple(t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)))
        if self.traced is None:
            outputs, self.traced = _traced_call(self.module, flat)
        else:
            outputs = self.traced(*flat)
        return outputs[0] if len(outputs) == 1 else outputs


def _traced_call(
    module: torch.fx.GraphModule, flat: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], torch.jit.ScriptFunction]:
    """`module`'s outputs on `flat` and its trace, from one run: the graph writes the KV
    cache in place, so it must not run twice on one call's inputs."""
    outputs: list[tuple[torch.Tensor, ...]] = []

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs.append(module(*tensors))
        return outputs[-1]

    with warnings.catch_warnings():
        # torch 2.13 marks torch.jit.trace deprecated in favour of torch.compile, whose
        # CPU backend compiles C++ at load; the trace needs no compiler and still runs
        # on the torch versions the reference backend supports (2.9, 2.13).
        warnings.filterwarnings("ignore", r"`torch\.jit\.trace` is deprecated", DeprecationWarning)
        traced = torch.jit.trace(run, flat, check_trace=False)
    return outputs[0], traced


def load_graph(folder: Path, name: str) -> LoadedGraph:
    """The graph `name` in `folder`, checked value by value (see the module doc)."""
    path = folder / f"{name}.json"
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise _fail(path, f"cannot read it as JSON ({err})") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise _fail(path, f"its format is not {FORMAT}")
    constants = load_tensors((folder / f"{name}.safetensors").read_bytes())
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    decode = _Decoder(path)
    users: dict[int, torch.fx.Node] = {}
    for i, spec in enumerate(_list(document, "inputs", path)):
        if isinstance(spec, dict) and type(spec.get("user")) is int:
            users[spec["user"]] = node = graph.placeholder(f"input_{spec['user']}")
        elif isinstance(spec, dict) and spec.get("tensor") in constants:
            root.register_buffer(f"constant_{i}", constants[spec["tensor"]])
            node = graph.get_attr(f"constant_{i}")
        else:
            raise _fail(path, f"input {json.dumps(spec)[:80]} is not allowed")
        decode.values.append(node)
    if sorted(users) != list(range(len(users))):
        raise _fail(path, "user inputs are not numbered 0..n-1")
    for spec in _list(document, "nodes", path):
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("args"), list)
            and isinstance(spec.get("kwargs"), dict)
        ):
            raise _fail(path, f"node {json.dumps(spec)[:80]} is malformed")
        if spec.get("op") == _ASSERT_NAME:  # returns None (files written before skipping it)
            decode.values.append(None)
            continue
        decode.values.append(
            graph.call_function(
                _resolve_op(spec.get("op"), path),
                tuple(decode(spec["args"])),
                {str(k): decode(v) for k, v in spec["kwargs"].items()},
            )
        )
    returned = []
    for spec in _list(document, "outputs", path):
        value = decode({"ref": spec.get("ref")} if isinstance(spec, dict) else spec)
        if isinstance(spec, dict) and "updates" in spec:
            if spec["updates"] not in users:
                raise _fail(path, f"output updates unknown input {spec['updates']!r}")
            graph.call_function(torch.ops.aten.copy_.default, (users[spec["updates"]], value))
        else:
            returned.append(value)
    graph.output(tuple(returned))
    graph.lint()
    return LoadedGraph(torch.fx.GraphModule(root, graph))


def _list(document: dict, field: str, path: Path) -> list:
    value = document.get(field)
    if not isinstance(value, list):
        raise _fail(path, f"field {field!r} is not a list")
    return value
