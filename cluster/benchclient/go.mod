module tidal.local/benchclient

go 1.22
