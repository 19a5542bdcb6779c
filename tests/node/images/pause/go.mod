module tidal.local/pause

go 1.22
