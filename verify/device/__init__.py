"""GPU machines without TVM: the bundle made here (bundle) and the check run there (check; started as
`python -m fuseguard.verify.devicecheck`)."""
