"""Outputs people and CI read: the terminal (console), JUnit XML (junit), the HTML report and its triptychs (html)."""
