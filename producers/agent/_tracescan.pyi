# The native scanner's interface (the module is C: _tracescan.c, whose head says what each part of the result is).
def scan(
    buffer: bytearray | bytes, lo: int, hi: int, /
) -> tuple[list[bytes], bytes, tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...]] | None: ...
