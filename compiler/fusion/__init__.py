"""Pipeline step 5, pattern fusion: the rule vocabulary (rules), the pattern table (patterns), legality,
the cost model and its measured decisions, the recognisers and replacements, and the fusion report."""
