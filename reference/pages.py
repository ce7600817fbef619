"""Page arithmetic shared by every part of the model."""


def div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def align_down(a: int, b: int) -> int:
    return a - a % b


def tokens_to_finish(cached_len: int, max_device_len: int, page_size: int) -> int:
    """Worst-case KV still to allocate, in tokens of whole pages, for a request holding
    the pages of [0, cached_len) that may grow to max_device_len tokens.

    The last sampled token never gets KV, so at most max_device_len - 1 positions are written.
    Counting whole pages is the fix for the seed's token-based reservation (see
    docs/deviations-from-the-seed.md): a request's next allocation is a page, not a token.
    """
    pages = div_ceil(max_device_len - 1, page_size) - div_ceil(cached_len, page_size)
    return max(pages, 0) * page_size
