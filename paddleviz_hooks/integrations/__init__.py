"""Adapters for training loops that are not yours: PaddleFormers' ``Trainer``
(:mod:`.paddleformers`, which imports PaddleFormers: import it where that is
installed). Any other loop, PaddleDetection's included, takes
:func:`paddleviz_hooks.attach`.
"""
