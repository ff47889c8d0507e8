"""Model families: one contract (and, where built, one adapter or binding) per family.

They are found by name through the family registry (`cadence_fx.families`, the entry points that
`families.py` here declares), so importing this package loads no vendor code.
"""
