from experiments.repro.staleness_real import main

main()
