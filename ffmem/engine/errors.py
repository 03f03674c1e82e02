"""The one base class of errors a user can fix; their messages say how. Importing it needs no torch."""


class FfmemError(Exception):
    """An error caused by input or environment, shown as one line (CLI) or a 4xx (web), never a traceback."""

    field: str | None = None  # the input at fault, where a form shows the message next to it
