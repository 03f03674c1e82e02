"""The paper's §5 analyses over held-out examples (`analyses`, Figs. 7–11) and its cases (`cases`)."""
