"""``vertexrt local-run --chaos``: the seeded fault certificate (schedule, outputs compared, driver)."""
