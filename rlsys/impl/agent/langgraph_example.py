"""A LangGraph ReAct agent with a calculator tool, trained unchanged through the endpoint.

    python3 training/main_async_ppo.py experiment=async-ppo-openai-agent \
        agent_function=rlsys.impl.agent.langgraph_example:run

Needs the `agents` extra (`pip install -e .[agents]`). The agent only knows an OpenAI base URL and key;
the `openai-agent` plugin (rlsys/impl/agent/openai_agent.py) records its calls token by token. It returns
None, so the experiment's environment scores its last answer.
"""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from rlsys.endpoint.http_client import shared_http_client
from rlsys.tools.calculator import evaluate, format_number


@tool
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression, such as 12*34+1."""
    return format_number(evaluate(expression))  # LangGraph's tool node tells the model what it raised


async def run(base_url: str, api_key: str, prompt: str) -> float | None:
    model = ChatOpenAI(base_url=base_url, api_key=api_key, model="rlsys", max_retries=0,
                       http_async_client=shared_http_client())  # the worker's pools, this run's key
    agent = create_react_agent(model, [calculator])
    await agent.ainvoke({"messages": [("user", prompt)]}, {"recursion_limit": 8})
    return None  # None: the environment scores the last answer
