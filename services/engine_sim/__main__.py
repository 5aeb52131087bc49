"""``python -m services.engine_sim --mode decode --port 30001 ...``"""

from services.engine_sim.main import main

raise SystemExit(main())
