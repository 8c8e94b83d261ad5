"""The placement audit's op recorder: a dispatch mode that watches every op of one model call on FakeTensor (or real)
weights and records, per op, where the model's tensors were (``Finding``): a cross-device op (moved and carried on, so
one run finds them all), host work on a tensor the loader left on the CPU, and its copy to the compute device; ComfyUI's
own casts of offloaded weights are counted apart. Host reads of small values computed from the inputs are answered
from real CPU shadows, so the control flow is the real one (``placement_audit``'s banner has the whole story)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

COMPUTE = torch.device("cuda", 0)
OFFLOAD = torch.device("cpu")
COPY_OPS = ("aten._to_copy.default", "aten.copy_.default")
SHADOW_MAX_ELEMENTS = 1 << 16  # real shadows are kept for control tensors (timesteps, position ids, masks), not activations
UNINITIALISED = ("aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                 "aten.new_empty.default", "aten.new_empty_strided.default")
WEIGHT_CAST = ("comfy/ops.py", "cast_bias_weight")  # where ComfyUI casts an offloaded layer's weights per call
INDEX_OPS = ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default")


@dataclass
class Finding:
    kind: str  # "cross-device", "host build", "host-to-device"
    module: str
    tensor: str
    op: str
    calls: int = 0
    bytes: int = 0
    accepted: str = ""  # why the pack leaves it, where it does


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_cpu_scalar(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dim() == 0


def _in_comfy_weight_cast() -> bool:
    """Whether the running op is inside ``comfy.ops.cast_bias_weight``, ComfyUI's cast of a layer's weights (casting
    ops and ``linear_input_act`` go through it, legacy and dynamic loads alike)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == WEIGHT_CAST[1] and code.co_filename.replace("\\", "/").endswith(WEIGHT_CAST[0]):
            return True
        frame = frame.f_back
    return False


class PlacementRecorder(TorchDispatchMode):
    """Runs every op (on FakeTensors where any operand or the target device is fake) and records placement faults."""

    def __init__(self, fake_mode, model: torch.nn.Module):
        super().__init__()
        self.fake_mode = fake_mode
        self.names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.weights = {id(p) for p in model.parameters()}
        self.derived: dict[int, tuple[torch.Tensor, str]] = {}  # host results of offloaded model tensors -> origin
        self.findings: dict[tuple, Finding] = {}
        self.weight_casts = self.weight_cast_bytes = 0
        self.module_stack: list[str] = []
        self.shadows: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}  # fake -> (fake, real value, storage)

    @contextlib.contextmanager
    def watching_modules(self, model: torch.nn.Module):
        paths = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

        def enter(module, args):
            self.module_stack.append(paths.get(id(module), type(module).__name__))

        def leave(module, args, output):
            self.module_stack.pop()

        handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                   torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, kind, tensor_name, func, nbytes):
        module = self.module_stack[-1] if self.module_stack else "<model>"
        key = (kind, module, tensor_name, str(func))
        finding = self.findings.setdefault(key, Finding(kind, module, tensor_name, str(func)))
        finding.calls += 1
        finding.bytes += nbytes

    def _is_weight_cast(self, weight) -> bool:
        """Whether this copy of an offloaded weight is ComfyUI's cast of it: made while the module that owns it runs
        (its op's cast), or by ``comfy.ops.cast_bias_weight`` (also reached from a parent, ``linear_input_act``). A
        module that copies a child's weight itself (``cast_to(self.q_norm.weight, device=x.device)``) bypasses the
        child's op: that copy is listed."""
        owner = self.names[id(weight)].rpartition(".")[0]
        return (bool(self.module_stack) and self.module_stack[-1] == owner) or _in_comfy_weight_cast()

    def _origin(self, tensor) -> str | None:
        """The model tensor ``tensor`` is, or was computed on the host from; None for anything else."""
        if id(tensor) in self.names and tensor.device.type == "cpu":
            return self.names[id(tensor)]
        entry = self.derived.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _real(self, value):
        """The real value of a tensor: itself when it is real, its shadow when it is fake (None: unknown)."""
        if not isinstance(value, FakeTensor):
            return value
        entry = self.shadows.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def _remember(self, fake_out, real_out):
        for fake, real in zip(tree_leaves(fake_out), tree_leaves(real_out), strict=True):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                self.shadows[id(fake)] = (fake, real, StorageWeakRef(fake.untyped_storage()))

    def _forget(self, tensor):
        """``tensor`` was written with values the recorder does not know: every shadow of its storage is stale."""
        storage = StorageWeakRef(tensor.untyped_storage())
        for key in [key for key, (_, _, other) in self.shadows.items() if other == storage]:
            del self.shadows[key]

    def _real_call(self, func, args, kwargs):
        """``func`` on the real values of its operands, on the CPU; None when an operand's value is unknown or large."""
        operands = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if str(func) in UNINITIALISED or any(t.numel() > SHADOW_MAX_ELEMENTS for t in operands):
            return None
        real = [self._real(t) for t in operands]
        if any(r is None for r in real):
            return None
        values = iter(real)
        real_args, real_kwargs = tree_map(lambda v: next(values) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        if "device" in real_kwargs:
            real_kwargs["device"] = OFFLOAD
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def _mask_positions(self, func, args):
        """A boolean mask whose values are known, as the index tensors of its positions (the shape a fake mask
        cannot give)."""
        if str(func) not in INDEX_OPS:
            return args
        indices = []
        for index in args[1]:
            real = self._real(index) if isinstance(index, FakeTensor) and index.dtype == torch.bool else None
            if real is None:
                indices.append(index)
                continue
            with unset_fake_temporarily():
                positions = real.nonzero(as_tuple=True)
            for position in positions:
                moved = FakeTensor(self.fake_mode, position.to("meta"), index.device)
                self._remember(moved, position)
                indices.append(moved)
        return (args[0], indices, *args[2:])

    def _call(self, func, args, kwargs, fake):
        if not fake:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if str(func) == "aten._local_scalar_dense.default":  # float(t), t.item(), t.tolist()
            real = self._real(args[0])
            if real is not None:
                with unset_fake_temporarily():
                    return real.item()
        args = self._mask_positions(func, args)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:  # unique, nonzero, ...: their output shape is known from the real values
            real_out = self._real_call(func, args, kwargs)
            if real_out is None:
                raise
            device = next(t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            out = tree_map(lambda r: FakeTensor(self.fake_mode, r.to("meta"), device)
                           if isinstance(r, torch.Tensor) else r, real_out)
            self._remember(out, real_out)
            return out
        real_out = self._real_call(func, args, kwargs)
        if real_out is not None:
            self._remember(out, real_out)
        else:
            for index, argument in enumerate(func._schema.arguments):
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, FakeTensor):
                    self._forget(value)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        target = kwargs.get("device")
        fake = any(isinstance(t, FakeTensor) for t in tensors) or (
            target is not None and torch.device(target).type == COMPUTE.type)
        origins = [o for o in map(self._origin, tensors) if o is not None]
        devices = {t.device for t in tensors if not _is_cpu_scalar(t)}
        is_copy = str(func) in COPY_OPS
        if len(devices) > 1 and not is_copy:
            stray = [t for t in tensors if t.device.type == "cpu" and not _is_cpu_scalar(t)]
            name = ", ".join(sorted({self._origin(t) or "activation" for t in stray}))
            self._record("cross-device", name, func, sum(map(_nbytes, stray)))

            def to_compute(value):
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not _is_cpu_scalar(value):
                    return value.to(COMPUTE)
                return value

            args, kwargs = tree_map(to_compute, (args, kwargs))
        out = self._call(func, args, kwargs, fake)
        if is_copy:
            source = args[1] if str(func) == COPY_OPS[1] else args[0]
            destination = args[0] if str(func) == COPY_OPS[1] else out
            if source.device.type == "cpu" and destination.device.type != "cpu":
                if id(source) in self.weights and self._is_weight_cast(source):
                    self.weight_casts += 1
                    self.weight_cast_bytes += _nbytes(source)
                elif id(source) in self.weights:  # a module copies another's offloaded weight, on every call
                    self._record("host-to-device", self.names[id(source)], func, _nbytes(source))
                elif origins:
                    self._record("host-to-device", origins[0], func, _nbytes(source))
                return out
            # a copy on the host (dynamic VRAM's cast of a weight for a CPU input) is host work like any other op
        if origins:
            results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            for result in results:
                self.derived[id(result)] = (result, origins[0])
            if results and not func.is_view:
                self._record("host build", origins[0], func, sum(map(_nbytes, results)))
        return out


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)
