"""Orchestration (import name `quantkit.pipelines`): models x recipes x suite -> run directory.

Pipeline specs are YAML files in this folder; the runner arrives with the "Pipeline" issue.
"""
