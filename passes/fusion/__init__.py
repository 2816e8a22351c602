"""Fusion support shared by the fusion passes: decision records, legality, profitability.

Legality (`legality.py`) answers "can these ops share a kernel without changing
what the program computes?"; profitability (`profitability.py`) answers
"which of the legal groupings do we form?". Every decision, made or refused,
is a `FusionRemark` (`remarks.py`) that `explain()` shows.
"""
