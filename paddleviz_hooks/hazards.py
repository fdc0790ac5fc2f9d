"""Grad node kinds that must not (or cannot usefully) get a post-hook.

One place, each entry with its reason, measured on Paddle 3.3.1 (see
``shared/notes/paddle-autograd.md`` and ``tests/test_op_zoo.py``, whose
sweep proves the list sufficient for the ops it covers). Nodes listed here
are still drawn; they just carry no gradient data on their outgoing edges.
"""

from __future__ import annotations

__all__ = ["hook_hazard"]

# A post-hook on a node with a multi-tensor (Tensor[]) input slot makes
# backward() raise "argument must be list of Tensor", whatever it returns.
MULTI_TENSOR_INPUT = frozenset(
    {
        "ConcatGradNode",
        "StackGradNode",
        "AddNGradNode",
        "AddNGradNodeFinal",
        "EinsumGradNode",
        "MultiDotGradNode",
        "RnnGradNode",
        "MeshgridGradNode",
        "BroadcastTensorsGradNode",
        "BlockDiagGradNode",
        "MultiplexGradNode",
        "CoalesceTensorGradNode",
        "UnstackGradNode",
        "SplitGradNode",
        "SplitWithNumGradNode",
        "UnbindGradNode",
        "FusedRotaryPositionEmbeddingGradNode",
        "WhereIndexGradNode",
        "AddNDoubleGradNode",
        "ConcatDoubleGradNode",
        "StackDoubleGradNode",
        "CudnnLstmGradNode",
        "MergedAdamGradNode",
        "CheckFiniteAndUnscaleGradNode",
        "SendUVGradNode",
        "CrossEntropyWithSoftmaxBwdWGradNode",
    }
)

# Registration succeeds but the hook never fires: harmless, but a node that
# claims to be hooked would then report "no gradient" misleadingly.
NEVER_FIRES_PREFIXES = ("GradNodePyLayer_", "Dy2StGradNode", "RunProgramGradNode")


def hook_hazard(node_name: str) -> str | None:
    """Why a node of this kind is not hooked, or None when hooking is safe.

    Args:
        node_name: the grad node class name (``GradNodeBase.name()``).

    Returns:
        A short reason shown in the graph, or None.

    Example:
        >>> hook_hazard("ConcatGradNode")
        'multi-tensor input: a post-hook breaks backward'
        >>> hook_hazard("MatmulGradNode") is None
        True
    """
    if node_name == "GradNodeAccumulation":
        return "leaf: Paddle refuses post-hooks on accumulation nodes"
    if node_name in MULTI_TENSOR_INPUT:
        return "multi-tensor input: a post-hook breaks backward"
    if node_name.startswith(NEVER_FIRES_PREFIXES):
        return "custom/compiled backward: post-hooks never fire"
    return None
