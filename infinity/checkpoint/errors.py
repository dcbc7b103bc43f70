"""The one exception type of the checkpoint package."""


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded.

    The message always names the checkpoint directory and, when one is at fault,
    the file (and tensor) concerned, plus what to do about it.
    """
