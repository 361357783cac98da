from mpgemm.demo import main

main()
