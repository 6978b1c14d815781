"""Operator tools behind the ``sglang-simm`` command; the backend never imports them."""
