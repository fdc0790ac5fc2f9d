"""Grad node kinds that must not (or cannot usefully) get a post-hook.

One place, each entry with its reason, measured on Paddle 3.3.1 (CPU build;
facts in ``docs/paddle-autograd.md``). ``tests/test_op_zoo.py``
proves the list sufficient: it sweeps 150 op cases reaching 131 grad node
kinds, and every kind it reaches is either hooked (119 kinds, gradients
bit-identical to an uncaptured run) or listed here; ``test_hazard_entries_are_necessary`` proves
each measurable entry necessary by hooking it and watching backward fail.
Nodes listed here are still drawn; their outgoing edges are filled where that
is exact: from the receiving node's hook (unless its kernel rewrote what it
received, see :data:`INPLACE_BACKWARD`), cut from what a Concat or Stack
received (``capture/cut.py``), or an ``add_n``'s incoming gradient.

The mechanism behind :data:`MULTI_TENSOR_INPUT`: Paddle converts a post-hook's
return value back with one tensor per forward input slot. A node whose
forward op took a ``Tensor[]`` input that needs gradients (``concat([a, b])``)
has a slot holding a list, and no return value converts: ``backward()``
raises ``argument (position 1) must be list of Tensor, but got list``
whatever the hook returns. A ``Tensor[]`` *output* is harmless (split,
unbind, unstack, and the double-grad nodes of concat and stack are hooked
safely), and so is a ``Tensor[]`` input that takes no gradient (the integer
``indices`` of ``index_put``).
"""

from __future__ import annotations

__all__ = ["hook_hazard", "EDGE_NOTES", "MULTI_TENSOR_INPUT", "UNMEASURED", "NEVER_FIRES_PREFIXES", "PROGRAM_OP_NOTE",
           "RECOMPUTE_INPUT_NOTE", "INPLACE_BACKWARD", "SHARES_RECEIVED_UNCHANGED"]

#: Measured: hooking these makes ``backward()`` raise (op cases in brackets).
MULTI_TENSOR_INPUT = frozenset(
    {
        "ConcatGradNode",  # concat, hstack/vstack, block_diag
        "StackGradNode",  # stack, cartesian_prod
        # add_n with 2+ inputs (one input would be safe, but the name is the
        # same); paddle.Model's loss is add_n(losses), so its root is one.
        "AddNGradNodeFinal",
        "EinsumGradNode",  # einsum (operands)
        "MultiDotGradNode",  # linalg.multi_dot
        "RnnGradNode",  # nn.LSTM / GRU / SimpleRNN (weight list, initial states)
        "MeshgridGradNode",  # meshgrid, cartesian_prod
        "BroadcastTensorsGradNode",  # broadcast_tensors
        "MultiplexGradNode",  # multiplex
    }
)

#: Not measurable on the CPU build (the op has only a GPU kernel), kept
#: unhooked because the op has a ``Tensor[]`` input that takes gradients,
#: the measured mechanism above.
UNMEASURED = frozenset(
    {
        "CudnnLstmGradNode",  # cudnn_lstm: WeightList is Tensor[]
    }
)

#: Registration succeeds but the hook never fires (measured: a custom
#: ``PyLayer``, reentrant ``recompute`` which is a PyLayer, and
#: ``paddle.jit.to_static``). Harmless, but the node would claim to be hooked
#: and then report no gradient, so it is not hooked.
NEVER_FIRES_PREFIXES = ("GradNodePyLayer_", "Dy2StGradNode")

#: Auto-parallel's explicit ``dist.reshard``: its post-hook never fires either
#: (measured on 2 CPU ranks, Paddle 3.3.1).
NEVER_FIRES = frozenset({"ReshardGradNode"})

#: The note of an op inside a ``to_static`` program (``capture/static.py``
#: opens the program behind a ``Dy2StGradNode``; its ops are named
#: ``dialect.op``, e.g. ``pd_op.matmul_grad``, which no grad node class is):
#: it is a real op of the program, but the program runs as a whole and no
#: gradient inside it can be seen.
PROGRAM_OP_NOTE = "inside a compiled program: not observed"

#: The note of a leaf of a backward run inside a PyLayer's backward (reentrant
#: recompute, ``capture/nested.py``): the detached copy of the block's input
#: that the PyLayer held; its gradient leaves the block through the PyLayer.
RECOMPUTE_INPUT_NOTE = "input of the recomputed block (a detached copy): the PyLayer passes its gradient on"

#: Why an edge leaving a node without a hook carries no gradient (``Edge.note``,
#: ``capture/joins.py``); ``{op}`` is the node's readable op name. A Concat's and an
#: AddN's outgoing gradients are read from what they received whenever that is exact.
EDGE_NOTES = {
    "received": "{op} takes no hook; what it received was not seen",
    "sizes": "{op} takes no hook; the sizes of its inputs are not known",
    "shared": "{op} takes no hook; its receiver adds it to other gradients",
    "other": "{op} takes no hook",
}


#: Measured (``tests/test_edge_truth.py`` checks each entry): the backward
#: kernels of these kinds write what they pass on into the very buffer they
#: received, whenever nothing else holds it (Paddle checks the buffer's use
#: count). Read after the node ran, that buffer holds the node's output, not
#: its input. A producer with a hook holds the buffer (no rewrite then); after
#: a producer without one (Concat, Stack, AddN...) or at the root, the
#: received gradient can only be read before the kernel runs (a tensor hook on
#: the root) or is recorded as not observed. The capture does not depend on
#: this list: it compares buffer addresses at run time.
INPLACE_BACKWARD = frozenset({
    "AcosGradNode", "AcoshGradNode", "AsinGradNode", "AsinhGradNode", "AtanGradNode", "AtanhGradNode",
    "CeilGradNode", "CeluGradNode", "ClipGradNode", "CosGradNode", "CoshGradNode", "EluGradNode",
    "ExpGradNode", "Expm1GradNode", "FloorGradNode", "GroupNormGradNode", "HardshrinkGradNode",
    "HardsigmoidGradNode", "HardswishGradNode", "HardtanhGradNode", "LeakyReluGradNode", "Log10GradNode",
    "Log1pGradNode", "Log2GradNode", "LogGradNode", "LogsigmoidGradNode", "MaskedFillGradNode",
    "MishGradNode", "PowGradNode", "ReciprocalGradNode", "Relu6GradNode", "ReluGradNode", "RoundGradNode",
    "RsqrtGradNode", "SigmoidGradNode", "SiluGradNode", "SinGradNode", "SinhGradNode", "SoftplusGradNode",
    "SoftshrinkGradNode", "SoftsignGradNode", "SqrtGradNode", "SquareGradNode", "SwishGradNode",
    "TanGradNode", "TanhGradNode", "TanhShrinkGradNode", "ThresholdedReluGradNode",
})

#: Measured: these pass the received buffer on as it is (same values, maybe
#: another shape): sharing it does not change what was received.
SHARES_RECEIVED_UNCHANGED = frozenset({
    "AddGradNode", "FlattenGradNode", "IndexAddGradNode", "ReshapeGradNode", "SqueezeGradNode",
    "SubtractGradNode", "TransposeGradNode",
})


def hook_hazard(node_name: str) -> str | None:
    """Why a node of this kind is not hooked, or None when hooking is safe.

    Args:
        node_name: the grad node class name (``GradNodeBase.name()``).

    Returns:
        A short reason shown in the graph, or None.

    Examples:
        >>> hook_hazard("ConcatGradNode")
        'multi-tensor input: a post-hook breaks backward'
        >>> hook_hazard("MatmulGradNode") is None
        True
        >>> hook_hazard("pd_op.matmul_grad")
        'inside a compiled program: not observed'
    """
    if node_name == "GradNodeAccumulation":
        return "leaf: Paddle refuses post-hooks on accumulation nodes"
    if node_name in MULTI_TENSOR_INPUT:
        return "multi-tensor input: a post-hook breaks backward"
    if node_name in UNMEASURED:
        return "multi-tensor input (GPU-only op, not measured): not hooked as a precaution"
    if node_name.startswith(NEVER_FIRES_PREFIXES):
        return "custom/compiled backward: post-hooks never fire"
    if node_name in NEVER_FIRES:
        return "reshard (communication): post-hooks never fire"
    if "." in node_name:
        return PROGRAM_OP_NOTE
    return None
