// benchclient calls a scheduler extender the way kube-scheduler does (Go's net/http,
// keep-alive, JSON bodies): one /filter with every candidate node, then one /prioritize
// with the nodes that passed, per sample; then, as the binding cycle does, one /bind of the
// pod to the best-scored node (not in the sample: kube-scheduler binds asynchronously). It
// prints per sample (milliseconds) the whole cycle and its HTTP part alone (request written
// to response read: the extender and the wire), the rest being the client's own JSON encoding
// and decoding.
//
//	benchclient -url http://127.0.0.1:PORT -args args.json -calls 300 -warmup 10
//
// args.json: {"NodeNames": [...], "Pods": [{...}, ...]}; pods are used in turn.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

type input struct {
	NodeNames []string                 `json:"NodeNames"`
	Pods      []map[string]interface{} `json:"Pods"`
}

type filterResult struct {
	NodeNames   []string          `json:"NodeNames"`
	FailedNodes map[string]string `json:"FailedNodes"`
	Error       string            `json:"Error"`
}

type hostPriority struct {
	Host  string `json:"Host"`
	Score int64  `json:"Score"`
}

// post returns the time between sending the request and having read the whole response.
func post(client *http.Client, url string, body interface{}, out interface{}) (time.Duration, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	resp, err := client.Post(url, "application/json", bytes.NewReader(data))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	wire := time.Since(start)
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s: HTTP %d: %s", url, resp.StatusCode, raw)
	}
	return wire, json.Unmarshal(raw, out)
}

// checkScores: every scored host was a candidate, once, with a score in 0..10 (hosts left out
// score 0 to kube-scheduler).
func checkScores(scores []hostPriority, candidates []string) error {
	allowed := make(map[string]bool, len(candidates))
	for _, name := range candidates {
		allowed[name] = true
	}
	for _, s := range scores {
		if !allowed[s.Host] {
			return fmt.Errorf("score for %q, not a candidate or listed twice", s.Host)
		}
		allowed[s.Host] = false
		if s.Score < 0 || s.Score > 10 {
			return fmt.Errorf("score %d for %q is outside 0..10", s.Score, s.Host)
		}
	}
	return nil
}

// bindBest binds the pod to its best-scored node (the first candidate when none scored).
func bindBest(client *http.Client, url string, pod map[string]interface{}, scores []hostPriority, candidates []string) error {
	if len(candidates) == 0 {
		return nil
	}
	best, top := candidates[0], int64(-1)
	for _, s := range scores {
		if s.Score > top {
			best, top = s.Host, s.Score
		}
	}
	meta, _ := pod["metadata"].(map[string]interface{})
	args := map[string]interface{}{"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": best}
	var result struct{ Error string }
	if _, err := post(client, url+"/bind", args, &result); err != nil {
		return err
	}
	if result.Error != "" {
		return fmt.Errorf("bind: %s", result.Error)
	}
	return nil
}

func main() {
	url := flag.String("url", "", "extender URL prefix, e.g. http://127.0.0.1:8890")
	argsPath := flag.String("args", "", "JSON file with NodeNames and Pods")
	calls := flag.Int("calls", 300, "measured samples")
	warmup := flag.Int("warmup", 10, "unmeasured samples first")
	flag.Parse()
	raw, err := os.ReadFile(*argsPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchclient:", err)
		os.Exit(2)
	}
	var in input
	if err := json.Unmarshal(raw, &in); err != nil || len(in.Pods) == 0 {
		fmt.Fprintln(os.Stderr, "benchclient: bad args file:", err)
		os.Exit(2)
	}
	client := &http.Client{Timeout: 30 * time.Second}
	samples := make([]float64, 0, *calls)
	wires := make([]float64, 0, *calls)
	passed := make([]int, 0, *calls)
	for i := 0; i < *calls+*warmup; i++ {
		pod := in.Pods[i%len(in.Pods)]
		start := time.Now()
		var filtered filterResult
		wire1, err := post(client, *url+"/filter", map[string]interface{}{"Pod": pod, "Nodes": nil, "NodeNames": in.NodeNames}, &filtered)
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchclient:", err)
			os.Exit(1)
		}
		var scores []hostPriority
		wire2, err := post(client, *url+"/prioritize", map[string]interface{}{"Pod": pod, "Nodes": nil, "NodeNames": filtered.NodeNames}, &scores)
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchclient:", err)
			os.Exit(1)
		}
		if err := checkScores(scores, filtered.NodeNames); err != nil {
			fmt.Fprintln(os.Stderr, "benchclient:", err)
			os.Exit(1)
		}
		if err := bindBest(client, *url, pod, scores, filtered.NodeNames); err != nil {
			fmt.Fprintln(os.Stderr, "benchclient:", err)
			os.Exit(1)
		}
		if i >= *warmup {
			samples = append(samples, float64(time.Since(start).Microseconds())/1000.0)
			wires = append(wires, float64((wire1+wire2).Microseconds())/1000.0)
			passed = append(passed, len(filtered.NodeNames))
		}
	}
	out, _ := json.Marshal(map[string]interface{}{"samples_ms": samples, "http_ms": wires, "passed": passed})
	fmt.Println(string(out))
}
