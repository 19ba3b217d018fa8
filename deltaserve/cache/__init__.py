"""Cache accounting: KV blocks and GDN state slots (pure Python, ids and counts only)."""
