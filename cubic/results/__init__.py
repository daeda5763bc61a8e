"""Reading a finished or running study: the pandas frame (`analysis.py`), plots and the HTML report.

Above `study` and `quality`."""
