"""The one exception type for mistakes a user can fix. The CLI prints it as a single line."""


class UserError(Exception):
    """A bad config value, a missing file, an unusable input: something the user fixes, not a bug."""
