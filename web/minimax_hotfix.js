// MiniMax Hotfix in ComfyUI's browser UI: node menu entries and workflow commands that move a workflow onto the
// pack. The swap itself runs on the server (POST /minimax_hotfix/swap, the pack's tools/swap_loaders.py), so the
// browser and the command line give the same result; swap_rules.js (generated from the tool) decides which nodes
// get which entry. A change is loaded as one step of the workflow's undo history.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { RULES } from "./swap_rules.js";

const FIX_COMMAND = "MiniMaxHotfix.FixWorkflow";
const REVERSE_COMMAND = "MiniMaxHotfix.ReverseWorkflow";

function applyType(node) {
  // The Apply node type this node's outputs need, or null: an output of MODEL/CLIP/VAE without an input of that type.
  const type = node.type ?? node.constructor?.comfyClass;
  if (!type || type in RULES.stock_to_pack || type.startsWith(RULES.pack_node_prefix)) return null;
  if (RULES.pass_through_types.includes(type) || node.isSubgraphNode?.()) return null;
  const inputTypes = new Set((node.inputs ?? []).map((slot) => slot.type));
  const wanted = (node.outputs ?? [])
    .filter((slot) => slot.type in RULES.apply_node && !inputTypes.has(slot.type) && slot.links?.length)
    .map((slot) => RULES.apply_node[slot.type][0]);
  return wanted.length ? wanted.join(", ") : null;
}

function toast(severity, summary, detail) {
  app.extensionManager.toast.add({ severity, summary, detail, life: 6000 });
}

async function loadAsOneStep(workflow, graph) {
  // Loads `graph` into the open workflow the way the frontend's own undo/redo does (ChangeTracker.updateState):
  // with the tracker marked as restoring, the load keeps the tracker's history and state instead of resetting
  // them; capturing afterwards makes the whole change one undo step and marks the workflow modified.
  const tracker = workflow?.changeTracker;
  tracker?.captureCanvasState();
  if (tracker) tracker._restoringState = true;
  try {
    await app.loadGraphData(graph, false, false, workflow, { checkForRerouteMigration: false });
  } finally {
    if (tracker) tracker._restoringState = false;
  }
  tracker?.captureCanvasState();
}

async function runSwap({ reverse = false, only = null } = {}) {
  // Serialises the whole workflow, lets the server swap it, loads the result into the same tab as one undo step.
  const workflow = app.extensionManager.workflow.activeWorkflow;
  const response = await api.fetchApi("/minimax_hotfix/swap", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ workflow: app.rootGraph.serialize(), reverse, only }),
  });
  const reply = await response.json();
  if (!response.ok) {
    toast("error", "MiniMax Hotfix", reply.error ?? `swap failed (${response.status})`);
    return reply;
  }
  if (reply.changed) await loadAsOneStep(workflow, reply.workflow);
  const notes = [...reply.warnings];
  if (reply.kept.length) notes.push(`kept, not inserted by MiniMax Hotfix: ${reply.kept.join(", ")}`);
  toast(reply.changed ? "success" : "info", "MiniMax Hotfix", [reply.summary, ...notes].join("\n"));
  return reply;
}

function nodeTarget(node) {
  // The root graph's own id is no subgraph id: the swap names the top level null.
  return { graph: !node.graph || node.graph.isRootGraph ? null : node.graph.id, node: node.id };
}

app.registerExtension({
  name: "MiniMaxHotfix.Swap",
  commands: [
    { id: FIX_COMMAND, label: "Fix this workflow with MiniMax Hotfix", function: () => runSwap() },
    { id: REVERSE_COMMAND, label: "Undo MiniMax Hotfix in this workflow (back to stock loaders)",
      function: () => runSwap({ reverse: true }) },
  ],
  menuCommands: [{ path: ["Extensions", "MiniMax Hotfix"], commands: [FIX_COMMAND, REVERSE_COMMAND] }],
  getNodeMenuItems(node) {
    const type = node.type ?? node.constructor?.comfyClass;
    const pack = RULES.stock_to_pack[type];
    if (pack) {
      return [{ content: `Replace with ${pack} (MiniMax Hotfix)`, callback: () => runSwap({ only: nodeTarget(node) }) }];
    }
    const apply = applyType(node);
    if (apply) {
      return [{ content: `Insert ${apply} after this node (MiniMax Hotfix)`,
                callback: () => runSwap({ only: nodeTarget(node) }) }];
    }
    return [];
  },
  getCanvasMenuItems() {
    return [{ content: "Fix this workflow with MiniMax Hotfix", callback: () => runSwap() }];
  },
});

export { runSwap };
