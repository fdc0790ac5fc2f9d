"""Adapters for training loops that are not yours: PaddleFormers' ``Trainer``
(:mod:`.paddleformers`) and PaddleDetection's (:mod:`.ppdet`). Each imports its
framework: import the one you use where it is installed. Any other loop takes
:func:`paddleviz_hooks.attach`.
"""
