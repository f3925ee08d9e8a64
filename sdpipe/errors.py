"""The one exception type for mistakes a user can fix. The CLI prints it as a single line."""


class UserError(Exception):
    """A bad config value, a missing file, an unusable input: something the user fixes, not a bug."""


def disk_full(exc: BaseException) -> bool:
    """Whether an error, or one it was raised from, is a full disk or quota. Libraries that write in native code
    (safetensors, torch) raise their own types, with the OS error only in the message."""
    import errno

    seen: list[BaseException] = [exc]
    while (nxt := seen[-1].__cause__ or seen[-1].__context__) and len(seen) < 20:
        seen.append(nxt)
    return any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
        or "No space left on device" in str(e)
        or "database or disk is full" in str(e)  # SQLite (the prepare and caption caches)
        or "os error 28" in str(e)
        for e in seen
    )
