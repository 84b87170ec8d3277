"""Public ops, one module per op family: the function, its argument checks and dispatch."""
