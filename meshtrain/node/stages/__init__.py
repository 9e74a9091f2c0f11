"""A pipeline (SkipPipe) swarm's peer: its run path (`peer`), one stage's trainer (`trainer`), the
state a stage hands over (`state`, `handover`), what stage peers announce (`announce`), assembling
the whole model (`export`), and a lab of simulated links (`lab`)."""
