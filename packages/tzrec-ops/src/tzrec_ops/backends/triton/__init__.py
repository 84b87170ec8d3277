"""Triton kernels: backends ``triton`` (pointer loads) and ``triton_tma`` (tensor descriptors).

Nothing here imports triton at package import; kernel modules do, and they are imported only
when a backend is selected.
"""
