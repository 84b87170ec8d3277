"""ROCm/HIP autotune configurations, shipped as a plugin of its own."""
