// The pod sandbox's process for the node tier: holds the pod's namespaces, reaps the
// children that end up re-parented to it, and exits at SIGTERM or SIGINT. Built static,
// so its image is this one file (no registry: registry.k8s.io/pause is not reachable here).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
