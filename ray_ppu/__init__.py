"""ray_ppu: Megatron-Core worker groups placed on PPU clusters by Ray Train."""

from ray_ppu import quiet as _quiet

_quiet.install()
