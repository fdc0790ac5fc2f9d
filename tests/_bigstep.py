"""Big step JSON files for the CLI's bounds, written as text without building a graph in memory."""

from __future__ import annotations

import json

_GRAD = '{"shape": [64, 64], "dtype": "float32", "norm": %r, "min": -0.5, "max": 0.5, "nan": 0, "inf": 0}'


def write_big_step(path: str, nodes: int, *, dangling: bool = False) -> int:
    """A captured-looking step of about ``nodes`` nodes: a chain of linear blocks, 4 nodes each
    (Add, Matmul and two parameters), every edge with gradient statistics.

    ``dangling``: the last edge points at node 99999999, which the file does not have.
    Returns the number of nodes written.
    """
    blocks = max(1, (nodes - 1) // 4)
    layers = {"": "Net", **{f"blocks.{k}": "Linear" for k in range(blocks)}}
    with open(path, "w") as f:
        f.write('{"format": "paddleviz-hooks/backward-graph", "version": 1, '
                '"meta": {"step": 2, "entry": "backward", "grad_stats": true}, ')
        f.write('"layers": ' + json.dumps(layers) + ', "nodes": [')
        f.write('{"id": 0, "kind": "root", "name": "loss", "op": "loss", "layer": null, "call": 0, "param": null, '
                '"shape": [], "dtype": "float32", "hooked": false, "note": null, "key": "root#0"}')
        for k in range(blocks):
            i = 1 + 4 * k
            lay = f"blocks.{k}"
            f.write(f', {{"id": {i}, "kind": "op", "name": "AddGradNode", "op": "Add", "layer": "{lay}", "call": 0, '
                    f'"param": null, "shape": null, "dtype": null, "hooked": true, "note": null, "key": "op:{lay}[0]/Add"}}')
            f.write(f', {{"id": {i + 1}, "kind": "op", "name": "MatmulGradNode", "op": "Matmul", "layer": "{lay}", '
                    f'"call": 0, "param": null, "shape": null, "dtype": null, "hooked": true, "note": null, '
                    f'"key": "op:{lay}[0]/Matmul"}}')
            for j, p in ((2, "bias"), (3, "weight")):
                f.write(f', {{"id": {i + j}, "kind": "param", "name": "GradNodeAccumulation", "op": "Parameter", '
                        f'"layer": null, "call": 0, "param": "{lay}.{p}", "shape": [64, 64], "dtype": "float32", '
                        f'"hooked": false, "note": null, "key": "param:{lay}.{p}", "grad": {_GRAD % (1.0 + k % 7)}}}')
        f.write('], "edges": [')
        sep = ""
        prev = 0
        for k in range(blocks):
            i = 1 + 4 * k
            for src, dst in ((prev, i), (i, i + 1), (i, i + 2), (i + 1, i + 3)):
                f.write(f'{sep}{{"src": {src}, "dst": {dst}, "slot": 0, "grad": {_GRAD % (0.5 + k % 5)}}}')
                sep = ", "
            prev = i + 1
        if dangling:
            f.write(f'{sep}{{"src": {prev}, "dst": 99999999, "slot": 1, "grad": null}}')
        f.write("]}")
    return 1 + 4 * blocks
