"""Small helpers shared across the library, standard library (and torch.distributed) only:
atomic file writes (:mod:`~ray_ppu.util.fs`), a free port (:mod:`~ray_ppu.util.net`), a
one-process group for tools and tests (:mod:`~ray_ppu.util.dist`), and the unwrapping of
Megatron's model wrappers (:mod:`~ray_ppu.util.wrappers`). The ground floor: it imports no
other part of ray_ppu.
"""
