"""The state a peer trains on and keeps: the run state (`run_state`: resume, download, parity,
checkpoints), crash-safe checkpoints (`checkpoint`), the state sync of late joiners (`sync`:
protocol, `fetch`: joiner, `donor`: server), parity of φ across peers (`parity`), and the
trainers a node has seen (`address_book`)."""
