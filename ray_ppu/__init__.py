"""ray_ppu: Megatron-Core worker groups placed on PPU clusters by Ray Train."""

from ray_ppu import lean_imports as _lean_imports
from ray_ppu import quiet as _quiet

_quiet.install()
_lean_imports.install()
