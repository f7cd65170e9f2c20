"""Bake a model into plain torch for deployment: fixed bases folded into static convolutions,
batch norms folded where that is exact, group pooling as a reduction.

``bake(model)`` returns a ``torch.fx.GraphModule`` whose only submodules are ``torch.nn``
layers (``Conv2d``, ``Linear``, ``MaxPool2d``, ``ReLU``) and whose graph otherwise calls
reshapes, slices, ``cat``, ``amax``, ``mul`` and ``add``: no rstmodel class, no einsum, no
basis expansion at run time. It computes the model's eval-mode logits.

Group layout. Inside a baked RST model a feature map ``[B, C, R, S, H, W]`` travels as a
batch of plain images ``[S*R*B, C, H, W]`` (scale slowest, then rotation, then the image),
so pooling, batch norm and 1x1 convolutions are ordinary 4D ops, and the (r, s) slice a
convolution reads is one contiguous block.

Convolutions. The layers are the one source of their weights: each RST convolution gives
its expanded filters (``expanded(s)``), its basis cut to each scale (``windowed_basis(s)``)
and its choice between two exact static forms per scale (``static_form(s)``: the one with
fewer multiply-adds per output pixel and group element, ``form_costs(s)``); this module only
arranges them into convolutions:

- DIRECT: the expanded filters as a static conv, ``Cin T Cout k_s^2``;
- BASIS: a static conv of every input plane with the K basis functions of that rotation
  and scale (1 -> K channels), then a 1x1 conv mixing the ``Cin T K`` responses into Cout
  channels, ``Cin T K (k_s^2 + Cout)``. The mixing weight is one tensor shared by every
  rotation and scale, so the file stores it once.

Batch norms (eval: ``y = a x + b`` per channel, ``a = gamma / sqrt(var + eps)``). Walking
back from each norm through ops that commute with a positive per-channel scale (ReLU,
max-pools, dropout, identity) to the convolution or linear layer that feeds only it:

- nothing but identities between them (the FC head's BatchNorm1d): folded entirely;
- otherwise ``|a|`` (where ``a != 0``) goes into that layer's weight and bias, and when
  only max-pools lie between them (no ReLU) and no ``a`` is negative, ``b`` goes into the
  bias too. ``b`` never goes into the *next* convolution: it zero-pads, so a constant input
  shift is not a constant output shift at the borders.

What stays is one per-channel ``x * sign(a) + b`` (Mul only if some ``a`` is negative or
zero, Add only if some ``b`` is non-zero). Walking forward from a norm through ops that
commute with a per-channel shift (max-pools, group max-pool, flatten, dropout) to a linear
layer, ``b`` goes into that layer's bias (``W (x + b) = W x + W b``), and the sign too when
no max lies between. So in the paper's models the last norm before the group max-pool and
FC head leaves at most a Mul by signs, and every other norm leaves one Mul/Add.

Quarter turns (``quarter_turns=True``). With one rotation tap in every group convolution,
R divisible by 4 and square maps, branch ``r + qR/4`` of every layer equals branch ``r`` run
on the input turned by q quarter turns (the sampled basis turns exactly, 'same' convolutions,
2x2 pools, per-channel maps and ReLU all commute with ``rot90``), and the final spatial group
max-pool takes the max over every branch. So the baked graph runs only the R/4 base
rotations, on the four turned copies of each image stacked into the batch, and the group
max-pool also takes the max over the copies: the same logits with a quarter of the
rotation-specific weights, each read once for four images.

The source model is never touched (a deep copy is baked).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from rstmodel.layers import (
    ConvMethod,
    GroupMaxPool,
    GroupRSTConv,
    LiftingRSTConv,
    RSTBatchNorm,
    RSTMaxPool,
    RSTPointwise,
)

__all__ = ["bake", "check_quarter_turns", "DIRECT", "BASIS", "FormRule"]

DIRECT, BASIS = ConvMethod.DIRECT, ConvMethod.BASIS

_RST_LAYERS = (LiftingRSTConv, GroupRSTConv, RSTBatchNorm, RSTMaxPool, GroupMaxPool, RSTPointwise)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, RSTBatchNorm)
_LINEAR_MAPS = (nn.Conv2d, nn.Conv3d, nn.Linear, LiftingRSTConv, GroupRSTConv, RSTPointwise)
_RESHAPES = (nn.Identity, nn.Dropout, nn.Flatten)  # identities up to a reshape
_MAX_POOLS = (nn.MaxPool2d, nn.AdaptiveMaxPool2d, GroupMaxPool)


# (layer, scale) -> DIRECT or BASIS; by default the layer's own ``static_form``
FormRule = Callable[[LiftingRSTConv | GroupRSTConv, int], ConvMethod]


def _own_form(layer: LiftingRSTConv | GroupRSTConv, s: int) -> ConvMethod:
    return layer.static_form(s)


def bake(
    model: nn.Module,
    example: Tensor | None = None,
    *,
    form: FormRule = _own_form,
    quarter_turns: bool = False,
) -> fx.GraphModule:
    """Plain-torch eval-mode copy of ``model`` (see the module docstring).
    x [B, C, H, W] -> logits [B, classes].

    ``example``: an input batch, needed only to fix adaptive pools to static ones; by
    default a zero image of the model's ``config`` (``in_channels``, ``input_size``).
    ``form(layer, s)``: DIRECT or BASIS for each convolution's scale (default the layer's
    own ``static_form``, which ``python -m export.forms_bench`` measured fastest in
    onnxruntime; other rules are for that comparison). ``quarter_turns``: the quarter-turn
    form (module docstring); a ValueError where the model does not allow it.
    """
    net = copy.deepcopy(model).eval()
    if hasattr(net, "plain"):  # a model built on another library gives its plain-torch copy
        config = getattr(net, "config", None)
        net = net.plain()
        net.config = config  # for the example input of adaptive pools
    entry = "logits" if hasattr(net, "logits") else "forward"
    with torch.no_grad():
        graph = _trace_layers(net, entry)
        if any(isinstance(m, nn.AdaptiveMaxPool2d) for m in graph.modules()):
            ShapeProp(graph).propagate(_example(net, example))
        _drop_identities(graph)
        _fold_norms(graph)
        copies = check_quarter_turns(net) if quarter_turns else 1
        _swap_layers(graph, _group_order(net), form, copies)
        if copies > 1:
            _turn_input(graph)
    name = f"Baked{type(model).__name__}"
    baked = fx.GraphModule(graph, fx.Tracer().trace(graph), class_name=name)
    for p in baked.parameters():
        p.requires_grad_(False)
    return baked.eval()


def _example(net: nn.Module, example: Tensor | None) -> Tensor:
    param = next(net.parameters())
    if example is None:
        config = getattr(net, "config", None)
        if config is None:
            raise ValueError(f"bake({type(net).__name__}) needs an example input batch")
        example = torch.zeros(1, config.in_channels, config.input_size, config.input_size)
    return example.to(device=param.device, dtype=param.dtype)


# ---------------------------------------------------------------- tracing


class _Root(nn.Module):
    """Tracing scaffold: calls ``net.<entry>(x)``; never part of a baked module."""

    def __init__(self, net: nn.Module, entry: str):
        super().__init__()
        self.net = net
        self.entry = entry

    def forward(self, x: Tensor) -> Tensor:
        return getattr(self.net, self.entry)(x)


class _LayerTracer(fx.Tracer):
    """Keeps the RST layers whole, so that passes see one node per layer."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _RST_LAYERS) or super().is_leaf_module(m, qualname)


def _trace_layers(net: nn.Module, entry: str) -> fx.GraphModule:
    root = _Root(net, entry)
    return fx.GraphModule(root, _LayerTracer().trace(root))


def _module(graph: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return graph.get_submodule(node.target) if node.op == "call_module" else None


def _set_module(graph: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(graph.get_submodule(parent) if parent else graph, name, module)


def check_quarter_turns(net: nn.Module) -> int:
    """4, or a ValueError saying why ``net`` has no quarter-turn form."""
    convs = [m for m in net.modules() if isinstance(m, (LiftingRSTConv, GroupRSTConv))]
    pools = [m for m in net.modules() if isinstance(m, GroupMaxPool)]
    why = []
    if not convs:
        why.append("no RST convolution")
    if any(m.spec.rotations % 4 for m in convs):
        why.append("R not divisible by 4")
    if any(isinstance(m, GroupRSTConv) and m.rotation_taps != 1 for m in convs):
        why.append("a group convolution with several rotation taps")
    if not pools or not all(p.spatial for p in pools):
        why.append("no spatial group max-pool before the head")
    if why:
        raise ValueError(f"quarter_turns needs {', '.join(why)} to be otherwise")
    return 4


def _turn_input(graph: fx.GraphModule) -> None:
    """Feed the model the four quarter turns of each input image, stacked on the batch:
    ``[B, C, H, W] -> [4*B, C, H, W]`` (``rot90`` and ``cat`` in the graph)."""
    x = next(n for n in graph.graph.nodes if n.op == "placeholder")
    users = [n for n in graph.graph.nodes if n in x.users]
    with graph.graph.inserting_before(users[0]):
        turns = [graph.graph.call_function(torch.rot90, (x, q, (-2, -1))) for q in (1, 2, 3)]
        stacked = graph.graph.call_function(torch.cat, ([x, *turns],))
    for user in users:
        user.replace_input_with(x, stacked)
    graph.recompile()


def _group_order(net: nn.Module) -> int:
    """R * S of the model's RST layers (1 for a plain model); they must agree."""
    orders = {
        m.spec.rotations * m.spec.num_scales
        for m in net.modules()
        if isinstance(m, (LiftingRSTConv, GroupRSTConv))
    }
    if len(orders) > 1:
        raise ValueError(f"bake needs one group size for every RST layer, found {sorted(orders)}")
    return orders.pop() if orders else 1


def _drop_identities(graph: fx.GraphModule) -> None:
    """Remove eval-mode no-ops (dropout, identity) from the graph."""
    for node in list(graph.graph.nodes):
        if isinstance(_module(graph, node), (nn.Identity, nn.Dropout)):
            node.replace_all_uses_with(node.args[0])
            graph.graph.erase_node(node)
    graph.graph.lint()
    graph.recompile()


# ---------------------------------------------------------------- batch-norm folding


def _norm_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """Eval-mode ``y = a x + b`` of a batch norm, float64 ``[C]`` each."""
    var = norm.running_var.double()
    a = torch.rsqrt(var + norm.eps)
    if norm.weight is not None:
        a = a * norm.weight.double()
    b = -norm.running_mean.double() * a
    if norm.bias is not None:
        b = b + norm.bias.double()
    return a, b


def _homogeneous(m: nn.Module) -> bool:
    """Commutes with a positive per-channel scale."""
    return isinstance(m, (*_RESHAPES, *_MAX_POOLS, nn.ReLU, RSTMaxPool))


def _shift_commuting(m: nn.Module) -> bool:
    """Commutes with a per-channel shift (and a positive scale)."""
    return isinstance(m, (*_RESHAPES, *_MAX_POOLS)) or (isinstance(m, RSTMaxPool) and not m.relu)


def _out_channels(m: nn.Module) -> int:
    if isinstance(m, nn.Linear):
        return m.out_features
    if isinstance(m, RSTPointwise):
        return m.conv.out_channels
    return m.out_channels


def _scale_outputs(m: nn.Module, scale: Tensor, shift: Tensor) -> None:
    """Replace output channel o of a linear map ``f`` by ``scale[o] f_o + shift[o]``."""
    if isinstance(m, RSTPointwise):
        m = m.conv
    w = m.weight
    w.copy_(w.double() * scale.view(-1, *([1] * (w.dim() - 1))))
    bias = torch.zeros_like(scale) if m.bias is None else m.bias.double()
    bias = bias * scale + shift
    if m.bias is None and bool(shift.ne(0).any()):
        m.bias = nn.Parameter(bias.to(w), requires_grad=False)
    elif m.bias is not None:
        m.bias.copy_(bias)


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _fold_backward(graph: fx.GraphModule, node: fx.Node, a: Tensor, b: Tensor):
    """Fold what is exact of ``a x + b`` into the linear map feeding ``node``; returns the
    residual (scale, shift)."""
    between = []
    prev = node.args[0]
    while isinstance(prev, fx.Node) and _single_user(prev) and _homogeneous(_module(graph, prev)):
        between.append(_module(graph, prev))
        prev = prev.args[0]
    source = _module(graph, prev) if isinstance(prev, fx.Node) else None
    if not (
        isinstance(source, _LINEAR_MAPS) and _single_user(prev) and _out_channels(source) == len(a)
    ):
        return a, b
    if all(isinstance(m, _RESHAPES) for m in between):
        _scale_outputs(source, a, b)
        return torch.ones_like(a), torch.zeros_like(b)
    scale = torch.where(a != 0, a.abs(), torch.ones_like(a))
    sign = a / scale
    if all(_shift_commuting(m) for m in between) and bool((sign == 1).all()):
        _scale_outputs(source, scale, b)
        return sign, torch.zeros_like(b)
    _scale_outputs(source, scale, torch.zeros_like(b))
    return sign, b


def _fold_forward(graph: fx.GraphModule, node: fx.Node, sign: Tensor, b: Tensor):
    """Fold the shift (and the sign, through identities only) into a linear layer reached
    through shift-commuting ops; returns the residual (scale, shift)."""
    between = []
    nxt = node
    while _single_user(nxt):
        nxt = next(iter(nxt.users))
        m = _module(graph, nxt)
        if not (m is not None and _shift_commuting(m)):
            break
        between.append(m)
    linear = _module(graph, nxt)
    if not isinstance(linear, nn.Linear) or linear.in_features % len(b):
        return sign, b
    repeat = linear.in_features // len(b)  # flattened [C, h, w] features, C slowest
    if repeat > 1 and not any(isinstance(m, nn.Flatten) for m in between):
        return sign, b
    w = linear.weight.double()
    bias = torch.zeros(linear.out_features, dtype=w.dtype, device=w.device)
    if linear.bias is not None:
        bias = linear.bias.double()
    bias = bias + w @ b.repeat_interleave(repeat)
    if linear.bias is None:
        linear.bias = nn.Parameter(bias.to(linear.weight), requires_grad=False)
    else:
        linear.bias.copy_(bias)
    if all(isinstance(m, _RESHAPES) for m in between):
        linear.weight.copy_(w * sign.repeat_interleave(repeat))
        sign = torch.ones_like(sign)
    return sign, torch.zeros_like(b)


class _ChannelAffine(nn.Module):
    """What is left of a batch norm: ``x * scale + shift`` per channel (dim 1)."""

    def __init__(self, scale: Tensor | None, shift: Tensor | None, dims: int):
        super().__init__()
        view = (-1,) + (1,) * (dims - 2)
        self.scale = None if scale is None else nn.Buffer(scale.view(view))
        self.shift = None if shift is None else nn.Buffer(shift.view(view))

    def forward(self, x: Tensor) -> Tensor:
        if self.scale is not None:
            x = x * self.scale
        if self.shift is not None:
            x = x + self.shift
        return x


def _fold_norms(graph: fx.GraphModule) -> None:
    for node in list(graph.graph.nodes):
        norm = _module(graph, node)
        if not isinstance(norm, _NORMS):
            continue
        a, b = _norm_affine(norm)
        sign, shift = _fold_backward(graph, node, a, b)
        sign, shift = _fold_forward(graph, node, sign, shift)
        if bool((sign == 1).all()) and bool((shift == 0).all()):
            node.replace_all_uses_with(node.args[0])
            graph.graph.erase_node(node)
            continue
        dtype = norm.running_var.dtype
        dims = 2 if isinstance(norm, nn.BatchNorm1d) else 4
        keep_scale = None if bool((sign == 1).all()) else sign.to(dtype)
        keep_shift = None if bool((shift == 0).all()) else shift.to(dtype)
        _set_module(graph, node.target, _ChannelAffine(keep_scale, keep_shift, dims))
    graph.graph.lint()
    graph.recompile()


# ---------------------------------------------------------------- layers in the group layout


def _static_conv(weight: Tensor, bias: Tensor | None = None) -> nn.Conv2d:
    """An ``nn.Conv2d`` ('same' zero padding, odd kernel) holding ``weight [out, in, k, k]``."""
    out, cin, k, _ = weight.shape
    conv = nn.Conv2d(cin, out, k, padding=k // 2, bias=bias is not None)
    conv.to(device=weight.device, dtype=weight.dtype)
    conv.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        conv.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return conv


class _BakedLifting(nn.Module):
    """Lifting convolution in the group layout.  x [B, Cin, H, W] -> [S*R*B, Cout, H, W]."""

    def __init__(self, layer: LiftingRSTConv, post: nn.Module, form: FormRule, rotations: int):
        super().__init__()
        self.post = post  # per-image ops applied to each (r, s) output
        spec = layer.spec
        rot, nk = rotations, spec.num_funcs  # the first `rotations` of R
        cin, cout = layer.in_channels, layer.out_channels
        a = layer.weight.detach()  # [Cout, Cin, K]
        bias = layer.bias.detach() if layer.bias is not None else None
        self.rotations, self.in_channels, self.num_funcs = rot, cin, nk
        self.forms = [form(layer, s) for s in range(spec.num_scales)]
        self.convs = nn.ModuleList()
        for s, chosen in enumerate(self.forms):
            if chosen == DIRECT:
                filt = layer.expanded(s)[:rot].detach().flatten(0, 1)  # [R*Cout, Cin, ks, ks]
                self.convs.append(_static_conv(filt, None if bias is None else bias.repeat(rot)))
            else:
                basis = layer.windowed_basis(s)[:, :rot].detach()  # [K, R, ks, ks]
                bank = basis.transpose(0, 1).flatten(0, 1).unsqueeze(1)  # [R*K, 1, ks, ks]
                self.convs.append(_static_conv(bank))
        self.mix = None
        if BASIS in self.forms:
            self.mix = _static_conv(a.reshape(cout, cin * nk, 1, 1), bias)  # [Cout, Cin*K, 1, 1]

    def forward(self, x: Tensor) -> Tensor:
        out = []
        for form, conv in zip(self.forms, self.convs, strict=True):
            if form == DIRECT:
                y = conv(x).unflatten(1, (self.rotations, -1))  # [B, R, Cout, H, W]
                out.append(self.post(y.transpose(0, 1).flatten(0, 1)))  # [R*B, Cout, H, W]
                continue
            y = conv(x.flatten(0, 1).unsqueeze(1))  # [B*Cin, R*K, H, W]
            y = y.unflatten(0, (-1, self.in_channels)).unflatten(2, (self.rotations, -1))
            y = y.permute(2, 0, 1, 3, 4, 5).flatten(0, 1).flatten(1, 2)  # [R*B, Cin*K, H, W]
            out.append(self.post(self.mix(y)))  # [R*B, Cout, H, W]
        return torch.cat(out)  # [S*R*B, Cout, H, W]


class _BakedGroupConv(nn.Module):
    """Group convolution in the group layout, one static conv (DIRECT) or basis conv plus
    shared 1x1 mixing (BASIS) per output (r, s).  x [S*R*B, Cin, H, W] -> [S*R*B, Cout, H, W]."""

    def __init__(self, layer: GroupRSTConv, post: nn.Module, form: FormRule, rotations: int):
        super().__init__()
        self.post = post  # per-image ops applied to each (r, s) output
        spec = layer.spec
        rot, nsc, nk = rotations, spec.num_scales, spec.num_funcs  # the first `rotations` of R
        cin, cout, taps = layer.in_channels, layer.out_channels, layer.taps
        a = layer.weight.detach().transpose(1, 2)  # [Cout, T, Cin, K]
        bias = layer.bias.detach() if layer.bias is not None else None
        self.rotations, self.scales = rot, nsc
        # (r', s') read by output (r, s) through tap t = (lt, la); s' >= S reads zeros
        self.reads = [
            [
                [
                    (int(layer.rot_index[lt, r]), s + la)
                    for lt in range(layer.rotation_taps)
                    for la in range(layer.scale_taps)
                ]
                for r in range(rot)
            ]
            for s in range(nsc)
        ]
        self.forms = [form(layer, s) for s in range(nsc)]
        self.convs = nn.ModuleList()
        for s, chosen in enumerate(self.forms):
            if chosen == DIRECT:
                filters = layer.expanded(s)[:rot].detach().flatten(2, 3)  # [R, Cout, T*Cin, ks, ks]
                per_rotation = nn.ModuleList(_static_conv(f, bias) for f in filters)
            else:
                basis = layer.windowed_basis(s).detach()  # [K, R, ks, ks]
                per_rotation = nn.ModuleList(
                    _static_conv(basis[:, r].unsqueeze(1))
                    for r in range(rot)  # [K, 1, ks, ks]
                )
            self.convs.append(per_rotation)
        self.mix = None
        if BASIS in self.forms:
            self.mix = _static_conv(a.reshape(cout, taps * cin * nk, 1, 1), bias)

    def forward(self, x: Tensor) -> Tensor:
        # [S*R*B, Cin, H, W] -> [B, Cin, H, W] per (s, r)
        blocks = x.unflatten(0, (self.scales * self.rotations, -1)).unbind(0)
        out = []
        for s, (form, per_rotation) in enumerate(zip(self.forms, self.convs, strict=True)):
            for r, conv in enumerate(per_rotation):
                reads = [
                    blocks[sr * self.rotations + rr]
                    if sr < self.scales
                    else torch.zeros_like(blocks[0])
                    for rr, sr in self.reads[s][r]
                ]
                xt = reads[0] if len(reads) == 1 else torch.cat(reads, dim=1)  # [B, T*Cin, H, W]
                if form == DIRECT:
                    out.append(self.post(conv(xt)))
                    continue
                y = conv(xt.flatten(0, 1).unsqueeze(1))  # [B*T*Cin, K, H, W]
                y = y.unflatten(0, (xt.shape[0], -1)).flatten(1, 2)  # [B, T*Cin*K, H, W]
                out.append(self.post(self.mix(y)))  # [B, Cout, H, W]
        return torch.cat(out)  # [S*R*B, Cout, H, W]


class _BakedGroupPool(nn.Module):
    """Max over the group (and space; and the quarter-turned copies of each image, which
    need the spatial max).  x [G*Q*B, C, H, W] -> [B, C] or [B, C, H, W]."""

    def __init__(self, group: int, spatial: bool, copies: int = 1):
        super().__init__()
        self.group, self.spatial, self.copies = group, spatial, copies

    def forward(self, x: Tensor) -> Tensor:
        x = x.unflatten(0, (self.group * self.copies, -1))  # [G*Q, B, C, H, W]
        return x.amax(dim=(0, 3, 4)) if self.spatial else x.amax(dim=0)


def _max_pool_for(pool: nn.AdaptiveMaxPool2d, size: Sequence[int]) -> nn.Module:
    """A fixed ``MaxPool2d`` with the adaptive pool's windows at input ``size`` (h, w),
    when they are evenly spaced and of one size; else the adaptive pool itself."""
    out = pool.output_size if isinstance(pool.output_size, tuple) else (pool.output_size,) * 2
    kernels, strides = [], []
    for n, m in zip(size, out, strict=True):
        m = n if m is None else m
        starts = [i * n // m for i in range(m)]
        ends = [math.ceil((i + 1) * n / m) for i in range(m)]
        lengths = {e - b for b, e in zip(starts, ends, strict=True)}
        steps = {b - a for a, b in zip(starts, starts[1:], strict=False)} or {1}
        if len(lengths) != 1 or len(steps) != 1:
            return pool
        kernels.append(lengths.pop())
        strides.append(steps.pop())
    return nn.MaxPool2d(tuple(kernels), tuple(strides))


class _Pool2x2(nn.Module):
    """2x2 max-pool (then ReLU) of plain images.  x [N, C, H, W] -> [N, C, H/2, W/2]."""

    def __init__(self, relu: bool):
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU() if relu else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.pool(x)
        return self.relu(y) if self.relu is not None else y


def _pointwise(m: RSTPointwise) -> nn.Conv2d:
    conv = m.conv
    return _static_conv(conv.weight.detach().flatten(1).unflatten(1, (-1, 1, 1)), conv.bias)


def _swap_layers(graph: fx.GraphModule, group: int, form: FormRule, copies: int = 1) -> None:
    """Replace every RST layer by its group-layout bake. The pooling and what is left of
    the batch norm after a convolution run on each of its (r, s) outputs before they are
    concatenated (they act per image), so the concatenation moves a quarter of the data.
    ``copies`` 4: the quarter-turn form (R/4 rotations, four turned copies per image)."""
    for node in list(graph.graph.nodes):
        m = _module(graph, node)
        if isinstance(m, (LiftingRSTConv, GroupRSTConv)):
            post, last = [], node
            while _single_user(last):
                user = next(iter(last.users))
                after = _module(graph, user)
                if isinstance(after, RSTMaxPool):
                    post.append(_Pool2x2(after.relu))
                elif isinstance(after, _ChannelAffine):
                    post.append(after)
                else:
                    break
                last = user
            if last is not node:
                last.replace_all_uses_with(node)
                for dead in reversed(list(_chain(node, last))):
                    graph.graph.erase_node(dead)
            baked = _BakedLifting if isinstance(m, LiftingRSTConv) else _BakedGroupConv
            new: nn.Module = baked(m, nn.Sequential(*post), form, m.spec.rotations // copies)
        elif isinstance(m, RSTMaxPool):
            new = _Pool2x2(m.relu)
        elif isinstance(m, GroupMaxPool):
            new = _BakedGroupPool(group // copies, m.spatial, copies)
        elif isinstance(m, RSTPointwise):
            new = _pointwise(m)
        elif isinstance(m, nn.AdaptiveMaxPool2d):
            new = _max_pool_for(m, node.args[0].meta["tensor_meta"].shape[-2:])
        else:
            continue
        _set_module(graph, node.target, new)
    graph.graph.eliminate_dead_code()
    graph.graph.lint()
    graph.delete_all_unused_submodules()
    graph.recompile()


def _chain(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes after ``first`` up to ``last`` along single users."""
    out, node = [], first
    while node is not last:
        node = next(iter(node.users))
        out.append(node)
    return out
