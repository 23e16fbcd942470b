"""elasticctl: the admin CLI (speaks to elasticd through the generated v1 code)."""
