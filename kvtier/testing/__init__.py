"""Test doubles and the fault simulator (docs/fault-sim.md): real implementations of kvtier's interfaces whose every outcome a test chooses."""
