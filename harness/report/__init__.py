"""Outputs people and CI read: the terminal (console), JUnit XML (junit), the HTML report (html) and its
triptychs (triptych), machine output (output: ``--json FILE`` or stdout), one number formatter (format)."""
