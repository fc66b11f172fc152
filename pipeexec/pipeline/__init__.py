"""The pipeline runtime: the action interpreter (`runtime`) and what it walks the schedule with:
point-to-point transfers (`p2p`), the backward and its I/W split (`backward`), a rank's stage
module (`stage`), and fault injection as a runtime observer (`faults`)."""
