"""mpgemm's test suite: a package, so that its helpers are imported by their full name
(``tests.accuracy``) and cannot shadow, or be shadowed by, a module of the same name."""
