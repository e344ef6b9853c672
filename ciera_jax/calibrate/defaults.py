"""What a calibration measures when the caller does not say: full-tensor sizes per platform.

Kept free of JAX so the command's help can quote them without starting it.
"""

CPU_SIZES = ("4K", "64K", "1M", "8M")  # gather fit (alpha, beta)
CPU_CODEC_SIZES = ("1M", "8M")  # codec fit
# host fault and cache-spill fit: plain gathers on the full mesh from below glibc's mmap
# threshold (fresh memory on every call above it, 32 MB at most) and the last-level cache (tens
# of MB) to above both; GPUs have neither (XLA's pooled buffers, no host copies)
CPU_FAULT_SIZES = ("8M", "16M", "24M", "32M", "48M")
GPU_SIZES = ("4K", "64K", "16M", "128M")
GPU_CODEC_SIZES = ("16M", "256M")
MESH_SIZES = (2, 4, 8, 16, 32, 64)  # sub-meshes timed, up to the devices present


def mesh_sizes_for(n_devices: int) -> list[int]:
    """The sub-meshes to time on ``n_devices``: powers of two up to it, and it."""
    sizes = [n for n in MESH_SIZES if n <= n_devices]
    if n_devices not in sizes and n_devices > 1:
        sizes.append(n_devices)
    return sizes
